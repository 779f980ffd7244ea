"""Schedules with a grammar on (`kvlab verify --json-schema`): the mask is part of the sampler's input.

A constrained greedy answer is first made the plain way: each step one full forward over the prompt and the
tokens so far (no cache), the grammar's mask, the argmax. Each schedule then makes the answer its own way
and must give the same tokens and the same masked logits: the same tokens allowed (-inf everywhere else) and
the allowed logits within verify's tolerance. A token or an allowed set that differs is an infinite error,
so a schedule whose masks depended on the batch, a padding row or a rollback would fail here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from kvlab.engine.engine import Engine
from kvlab.model.llama import LlamaModel
from kvlab.sampling.grammar import CompiledGrammar, mask_logits
from kvlab.sampling.sampler import Sampler, SamplingParams, log_probs
from kvlab.verify.schedules import paged_logits

Schedule = tuple[str, str, Callable[[], tuple[float, float]]]


@dataclass
class Answer:
    """A constrained greedy answer: its tokens, and the logits before each draw, raw and masked."""

    tokens: list[int] = field(default_factory=list)
    raw: list[np.ndarray] = field(default_factory=list)
    masked: list[np.ndarray] = field(default_factory=list)

    def add(self, token: int, raw: np.ndarray, masked: np.ndarray) -> None:
        self.tokens.append(int(token))
        self.raw.append(np.asarray(raw, dtype=np.float64))
        self.masked.append(np.asarray(masked, dtype=np.float64))


def reference_answer(model: LlamaModel, grammar: CompiledGrammar, prompt: Sequence[int], max_new: int) -> Answer:
    """The plain twin: a full forward per step, the mask of a lone matcher, the argmax; ends at the EOS."""
    matcher, answer = grammar.matcher(), Answer()
    while len(answer.tokens) < max_new and not matcher.done:
        raw = model.forward(np.array([list(prompt) + answer.tokens])).logits[0, -1:]
        masked = mask_logits(raw, [matcher])
        token = int(np.argmax(masked[0]))
        answer.add(token, raw[0], masked[0])
        matcher.advance(token)
    return answer


def cached_answers(model: LlamaModel, grammar: CompiledGrammar, prompts: Sequence[Sequence[int]], max_new: int,
                   prefill_sizes: Sequence[int]) -> list[Answer]:
    """Equal-length prompts through one contiguous cache: prefilled together in `prefill_sizes` chunks, then one
    token a step, every row drawn by one Sampler (the masks of all rows filled together). A finished row is
    padding (its EOS fed again) until every row is done."""
    ids = np.array([list(p) for p in prompts])
    sampler = Sampler(SamplingParams(grammar=grammar))
    matchers = sampler.row_matchers(len(prompts))
    cache, start = None, 0
    for size in prefill_sizes:
        out = model.forward(ids[:, start:start + size], cache=cache, use_cache=True)
        cache, start = out.cache, start + size
    answers = [Answer() for _ in prompts]
    for _ in range(max_new):
        live = [not m.done for m in matchers]
        if not any(live):
            break
        raw = out.logits[:, -1]
        masked = mask_logits(raw, matchers)  # what the sampler sees: recorded, then drawn by the sampler itself
        tokens = sampler(raw)
        for row, answer in enumerate(answers):
            if live[row]:
                answer.add(tokens[row], raw[row], masked[row])
        out = model.forward(tokens[:, None], cache=cache, use_cache=True)
        cache = out.cache
    return answers


def compare(got: Answer, want: Answer, logprobs: Sequence[float] | None = None) -> tuple[float, float]:
    """(max abs error of the masked logits, max |allowed logit| of `want`); infinite if a token or an allowed
    set differs. `logprobs`: the engine's log-probabilities of its tokens, compared with the reference's
    (the model's distribution before the mask, as vLLM reports it) instead of the masked logits."""
    want_masked = np.array(want.masked)
    allowed = np.isfinite(want_masked)
    scale = float(np.abs(want_masked[allowed]).max()) if allowed.any() else 0.0
    if got.tokens != want.tokens:
        return float("inf"), scale
    if logprobs is not None:
        # the reference's log-softmax as the engine's sampler computes it: equal logits, equal logprobs
        ref = np.array([log_probs(row) for row in want.raw]) if len(want.raw) else np.zeros((0, 0))
        picked = ref[np.arange(len(want.tokens)), want.tokens]
        return (float(np.abs(np.array(logprobs) - picked).max()) if len(picked) else 0.0,
                float(np.abs(ref).max()) if len(picked) else 0.0)
    got_masked = np.array(got.masked)
    if not np.array_equal(np.isfinite(got_masked), allowed):
        return float("inf"), scale
    return (float(np.abs(got_masked[allowed] - want_masked[allowed]).max()) if allowed.any() else 0.0), scale


def _worst(pairs: Sequence[tuple[float, float]]) -> tuple[float, float]:
    return max(p[0] for p in pairs), max(p[1] for p in pairs)


def structured_schedules(model: LlamaModel, grammar: CompiledGrammar, rng: np.random.Generator, length: int,
                         tokenizer: object = None) -> list[Schedule]:
    """(name, description, run) for each grammar schedule; run() returns (max abs error, max |reference|) as
    verify's other schedules do. Answers have at most `length` tokens (fewer where the grammar ends them)."""
    vocab = model.config.vocab_size
    prompt_len = max(2, length // 2)
    max_new = max(1, min(length, model.config.max_position_embeddings - prompt_len - 1))

    def prompts(count: int) -> list[list[int]]:
        return [rng.integers(0, vocab, prompt_len).tolist() for _ in range(count)]

    def chunk_sizes(total: int) -> list[int]:
        sizes = []
        while total > 0:
            sizes.append(int(rng.integers(1, min(total, 7) + 1)))
            total -= sizes[-1]
        return sizes

    def decode() -> tuple[float, float]:
        prompt = prompts(1)
        return compare(cached_answers(model, grammar, prompt, max_new, [prompt_len])[0],
                       reference_answer(model, grammar, prompt[0], max_new))

    def chunks() -> tuple[float, float]:
        prompt = prompts(1)
        return compare(cached_answers(model, grammar, prompt, max_new, chunk_sizes(prompt_len))[0],
                       reference_answer(model, grammar, prompt[0], max_new))

    def batch() -> tuple[float, float]:
        group = prompts(3)
        got = cached_answers(model, grammar, group, max_new, chunk_sizes(prompt_len))
        return _worst([compare(g, reference_answer(model, grammar, p, max_new)) for g, p in zip(got, group)])

    def paged() -> tuple[float, float]:
        """The reference answers fed through the batched paged forward in random chunks; each row's mask
        replayed over its answer, the three rows' masks filled together."""
        group = prompts(3)
        wants = [reference_answer(model, grammar, p, max_new) for p in group]
        seqs = [p + w.tokens for p, w in zip(group, wants)]
        logits = paged_logits(model, seqs, [chunk_sizes(len(s)) for s in seqs], block_size=4)
        matchers = [grammar.matcher() for _ in group]
        gots = [Answer() for _ in group]
        for step in range(max(len(w.tokens) for w in wants)):
            rows = [i for i, w in enumerate(wants) if step < len(w.tokens)]
            # a finished row repeats its last position, unmasked, as the engine's padding would
            raw = np.stack([logits[i][min(prompt_len - 1 + step, len(logits[i]) - 1)] for i in range(len(group))])
            masked = mask_logits(raw, [matchers[i] if i in rows else None for i in range(len(group))])
            for i in rows:
                gots[i].add(int(np.argmax(masked[i])), raw[i], masked[i])
                matchers[i].advance(wants[i].tokens[step])
        return _worst([compare(g, w) for g, w in zip(gots, wants)])

    def engine() -> tuple[float, float]:
        """Requests sharing a stem through an Engine: warm prefix cache, a pool that preempts, 5-token chunks;
        tokens and their logprobs against the reference."""
        stem = rng.integers(0, vocab, max(1, prompt_len - 2)).tolist()
        group = [stem + rng.integers(0, vocab, 2).tolist() for _ in range(3)]
        params = SamplingParams(max_tokens=max_new, logprobs=0, grammar=grammar)
        eng = Engine(model, tokenizer, block_size=4, num_blocks=-(-(prompt_len + max_new) // 4) + 2,
                     max_num_batched_tokens=5)
        eng.generate([group[0]], params)  # warm the prefix cache
        results = []
        for prompt, out in zip(group, eng.generate(group, params)):
            sample, want = out.outputs[0], reference_answer(model, grammar, prompt, max_new)
            got = Answer(tokens=list(sample.token_ids))
            results.append(compare(got, want, [lp[t] for t, lp in zip(sample.token_ids, sample.logprobs)]))
        return _worst(results)

    def speculative() -> tuple[float, float]:
        """Prompt lookup under the grammar: a prompt that holds its own answer twice, so guesses are drafted,
        checked against the mask and rolled back with it; tokens and logprobs against the reference."""
        stem = prompts(1)[0]
        prompt = stem + reference_answer(model, grammar, stem, max_new).tokens[:-1] + stem
        prompt = prompt[-(model.config.max_position_embeddings - max_new - 1):]
        want = reference_answer(model, grammar, prompt, max_new)
        config = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
        eng = Engine(model, tokenizer, block_size=4, speculative_config=config)
        sample = eng.generate([prompt], SamplingParams(max_tokens=max_new, logprobs=0, grammar=grammar))[0].outputs[0]
        return compare(Answer(tokens=list(sample.token_ids)), want,
                       [lp[t] for t, lp in zip(sample.token_ids, sample.logprobs)])

    return [
        ("schema decode", f"grammar on: prefill {prompt_len}, then one token a step", decode),
        ("schema chunks", "grammar on: random prefill chunks (1-7), then one token a step", chunks),
        ("schema batch", "grammar on: 3 sequences, masks filled together, finished rows padded", batch),
        ("schema paged", "grammar on: answers through the batched paged forward, random chunks", paged),
        ("schema engine", "grammar on: Engine, shared stem, warm prefix cache, tight pool, 5-token chunks",
         engine),
        ("schema speculative", "grammar on: Engine with prompt lookup (4 guesses), the answer in its prompt",
         speculative),
    ]
