"""Engine schedules for the verifier (`kvlab verify`): the paged, batched path against a full recompute.

Two schedules join verify's list (ARCHITECTURE.md invariant 9): "paged" feeds three sequences in random chunks
through one batched paged forward per step and compares every position's logits with a full forward;
"engine" runs requests sharing a prefix through an Engine with a pool small enough to preempt, chunked
prefill and a warm prefix cache, and compares each generated token's logprob with the full recompute's
(the engine exposes logprobs, not logits; a token that differs from the recompute's argmax counts as an
infinite error). Two more run speculative decoding (issue 35) the same way: "speculative" with prompt lookup
over prompts that repeat a motif, "speculative-draft" with the model guessing for itself and every
proposal's last guess spoiled, so most verifications keep some guesses and reject the rest; both in a tight
pool with chunked prefill and a warm prefix cache. Every emitted token's logprob comes from a verified row
(a one-token query among k + 1) and must equal the full recompute's; a schedule in which no guess was kept
and none rejected proved nothing and reports an infinite error. "policy" runs the engine under cache
policies (sinks, context shift) and compares every prompt position's logits (Engine.score) with the
policy done by hand on the contiguous reference cache (kvlab/verify/policy_reference.py): a policy has no
full recompute, but it has a plain one.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from kvlab.cache.paged import BlockPool, slot_mapping
from kvlab.engine.draft import DraftProposer
from kvlab.engine.engine import Engine
from kvlab.model.batch import BatchInput
from kvlab.sampling.sampler import SamplingParams, log_probs
from kvlab.model.llama import LlamaModel
from kvlab.policies.shift import ContextShift
from kvlab.policies.sinks import AttentionSinks
from kvlab.verify.policy_reference import PolicyCache


def paged_logits(model: LlamaModel, prompts: Sequence[Sequence[int]], chunks: Sequence[Sequence[int]],
                 block_size: int, kv_dtype: object = None) -> list[np.ndarray]:
    """Feed each prompt in its chunk sizes, every sequence in the same steps; the logits of every position."""
    c = model.config
    pool = BlockPool(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, kv_dtype or model.dtype,
                     block_size, num_blocks=sum(-(-len(p) // block_size) for p in prompts))
    tables: list[list[int]] = [[] for _ in prompts]
    done = [0] * len(prompts)
    logits = [np.zeros((len(p), c.vocab_size)) for p in prompts]
    queues = [list(sizes) for sizes in chunks]
    while any(queues):
        ids, slots, qlens, members = [], [], [], []
        for s, prompt in enumerate(prompts):
            if not queues[s]:
                continue
            n, start = queues[s].pop(0), done[s]
            tables[s] += pool.allocate(pool.blocks_for(start + n) - len(tables[s]))
            ids.extend(prompt[start:start + n])
            slots.append(slot_mapping(tables[s], start, n, block_size))
            qlens.append(n)
            members.append(s)
            done[s] += n
        batch = BatchInput(np.array(ids), np.concatenate([np.arange(done[s] - n, done[s])
                                                          for s, n in zip(members, qlens)]),
                           qlens, [done[s] for s in members], [tables[s] for s in members],
                           np.concatenate(slots), np.arange(len(ids)))
        out = model.forward_batch(batch, pool)
        row = 0
        for s, n in zip(members, qlens):
            logits[s][done[s] - n:done[s]] = out[row:row + n]
            row += n
    return logits


def engine_schedules(model: LlamaModel, rng: np.random.Generator,
                     length: int) -> list[tuple[str, str, Callable[[], tuple[float, float]]]]:
    """(name, description, run) for the paged schedules; run() returns (max abs error, max |reference|),
    as verify's own schedules do, so the same scaled tolerance applies."""
    vocab = model.config.vocab_size

    def chunk_sizes(total: int) -> list[int]:
        sizes = []
        while total > 0:
            sizes.append(int(rng.integers(1, min(total, 7) + 1)))
            total -= sizes[-1]
        return sizes

    def paged() -> tuple[float, float]:
        prompts = [rng.integers(0, vocab, int(rng.integers(1, length + 1))).tolist() for _ in range(3)]
        got = paged_logits(model, prompts, [chunk_sizes(len(p)) for p in prompts], block_size=4)
        wants = [model.forward(np.array([p])).logits[0] for p in prompts]
        return (max(float(np.abs(g - w).max()) for g, w in zip(got, wants)),
                max(float(np.abs(w).max()) for w in wants))

    def engine(speculative: str | None = None) -> tuple[float, float]:
        # prompt lookup on a random model guesses only when an output token was seen before: a few fresh
        # prompts until one gave it something to verify (deterministic: drawn from rng)
        for _ in range(8 if speculative == "ngram" else 1):
            error, scale, kept, guessed = engine_once(speculative)
            if guessed or speculative is None:
                break
        if speculative is not None and not (guessed > 0 and (speculative == "ngram" or 0 < kept < guessed)):
            return float("inf"), scale  # nothing verified (or, spoiled, not both kept and rejected): unproved
        return error, scale

    def engine_once(speculative: str | None) -> tuple[float, float, int, int]:
        """(max error, max |reference|, guesses kept, guesses made) of one engine run."""
        stem_len, new_tokens = max(1, length // 2), max(1 if speculative is None else 6, length // 4)
        stem = rng.integers(0, vocab, stem_len).tolist()
        prompts = [stem + rng.integers(0, vocab, int(rng.integers(1, length // 4 + 2))).tolist()
                   for _ in range(3)]
        spec = None
        if speculative == "ngram":  # X + the model's greedy continuation of X + X: lookup guesses it again
            prompts = [_echo(model, p[:max(2, len(p) // 3)], new_tokens) for p in prompts]
            spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
        elif speculative == "draft":  # its own guesses, the last of each spoiled (set below)
            spec = {"method": "ngram", "num_speculative_tokens": 3}
        params = SamplingParams(max_tokens=new_tokens, logprobs=0, ignore_eos=True)
        longest = max(len(p) for p in prompts) + new_tokens
        eng = Engine(model, block_size=4, num_blocks=-(-longest // 4) + 2 + (spec is not None),
                     max_num_batched_tokens=5, speculative_config=spec)
        if speculative == "draft":
            eng.speculator.draft = _SpoiledDraft(DraftProposer(model), vocab)
        eng.generate([prompts[0]], params)  # warm the prefix cache
        error = scale = 0.0
        for prompt, out in zip(prompts, eng.generate(prompts, params)):
            sample = out.outputs[0]
            # the recompute's log-softmax as the engine's sampler computes it (sampler.log_probs): equal logits
            # give equal logprobs, so a batch-invariant model checks to 0 here as in the logits schedules
            logits = model.forward(np.array([prompt + sample.token_ids[:-1]])).logits[0]
            full = np.stack([log_probs(row) for row in logits[len(prompt) - 1:]])
            scale = max(scale, float(np.abs(full).max()))
            for i, (token, logprobs) in enumerate(zip(sample.token_ids, sample.logprobs)):
                row = full[i]
                if token != int(np.argmax(row)):
                    error = float("inf")
                error = max(error, abs(logprobs[token] - float(row[token])))
        stats = eng.stats()
        return error, scale, stats["spec_decode_num_accepted_tokens"], stats["spec_decode_num_draft_tokens"]

    def policy() -> tuple[float, float]:
        """The engine under sinks (its prefix rows re-rotated into private blocks) and a context shift, a
        prompt twice their budget in random chunks, against the policy done by hand (PolicyCache), which
        itself equals a full recompute up to its first eviction."""
        error = scale = 0.0
        for kv_policy in (AttentionSinks(2, max(3, length // 3)), ContextShift(1, max(4, length // 2))):
            prompt = rng.integers(0, vocab, 2 * kv_policy.budget + 3).tolist()
            chunk = int(rng.integers(1, min(5, kv_policy.max_chunk) + 1))
            bound = -(-kv_policy.budget // 4) + 2
            eng = Engine(model, block_size=4, num_blocks=2 * bound + 2, max_num_batched_tokens=chunk,
                         kv_policy=kv_policy, enable_prefix_caching=False)
            got = np.stack(eng.score(prompt).logits)
            want = PolicyCache(model, kv_policy).feed(prompt, chunk)
            # the rows computed before the first eviction (every chunk ending within the budget) are plain
            # cached rows: the reference must equal a full recompute there (a model that is not causal fails)
            clean = kv_policy.budget // chunk * chunk
            full = model.forward(np.array([prompt[:clean]])).logits[0]
            error = max(error, float(np.abs(got - want).max()), float(np.abs(want[:clean] - full).max()))
            scale = max(scale, float(np.abs(want).max()))
        return error, scale

    # the engine runs no cache policy on a model that bounds its own attention (sliding-window layers)
    policies = [] if model.config.sliding_window or model.config.hybrid else [
        ("policy", "Engine under sinks, then a context shift (random chunks) vs the policy by hand", policy)]
    return [
        ("paged", "3 sequences batched in one paged forward per step, random chunks", paged),
        ("engine", "Engine: shared prefix, warm prefix cache, tight pool (preempts), 5-token chunks", engine),
        ("speculative", "Engine + ngram prompt lookup (k=4) on repeating prompts, tight pool, 5-token chunks",
         lambda: engine("ngram")),
        ("speculative-draft", "Engine + the model as its own draft (k=3, last guess spoiled): kept and "
                              "rejected guesses, tight pool", lambda: engine("draft")),
        *policies,
    ]


def _echo(model: LlamaModel, head: list[int], new_tokens: int) -> list[int]:
    """head + its greedy continuation + head: a prompt whose end was seen before, followed by text the model
    itself wrote (what prompt lookup bets on)."""
    ids = list(head)
    for _ in range(new_tokens):
        ids.append(int(np.argmax(model.forward(np.array([ids])).logits[0, -1])))
    return ids + list(head)


class _SpoiledDraft:
    """A draft proposer whose proposals end in a wrong token: verification keeps the good guesses and rolls
    back the spoiled one, every step."""

    def __init__(self, inner: DraftProposer, vocab: int) -> None:
        self.inner, self.vocab = inner, vocab

    def propose(self, seq: object, count: int) -> list[int]:
        guesses = self.inner.propose(seq, count)
        if len(guesses) > 1:
            guesses[-1] = (guesses[-1] + 1) % self.vocab
        return guesses

    def rollback(self, seq: object) -> None:
        self.inner.rollback(seq)
