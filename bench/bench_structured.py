"""What structured output costs: decode with a grammar mask vs unconstrained decode, side by side in one run.

On the shipped model (`kvlab.load()`, 3.3M parameters, 4096 tokens), for a JSON schema with a free string:

- batch 1: `stream_generate` (the CLI's decode loop) with the schema vs without it, time per new token;
- batch 8: the engine with 8 requests at once (a mask per sequence, filled together) vs 8 without;
- the mask alone: filling, applying and advancing it per token, replayed over the constrained answers;
- compiling a typical schema (a cold compile, and a hit in the LRU).

The unconstrained runs generate as many tokens as the constrained ones (ignore_eos), so both decode at the
same context lengths; rounds alternate which goes first; quoted: the median of the rounds' ratios, and the
ratio of each mode's best round (a shared machine's noise only ever adds time).
The schema's string is exactly 300 characters, longer than the answers timed, so every constrained answer
runs to --tokens too. A 3.3M model's step is ~1-2 ms, so the mask is a larger share here than on a 135M model (~8 ms a step).

    python bench/bench_structured.py [--rounds 5] [--tokens 96]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import kvlab
from kvlab import Engine, SamplingParams
from kvlab.generation.generate import stream_generate
from kvlab.sampling.grammar import (GrammarCache, GrammarSpec, compile_grammar, grammar_vocab, mask_logits)

FREE_STRING = {"type": "object", "additionalProperties": False, "required": ["speaker", "line"],
               "properties": {"speaker": {"enum": ["ROMEO", "JULIET", "NURSE"]},
                              "line": {"type": "string", "minLength": 300, "maxLength": 300}}}
TYPICAL = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags", "address"],
           "properties": {"name": {"type": "string", "maxLength": 40},
                          "age": {"type": "integer", "minimum": 0, "maximum": 150},
                          "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
                          "address": {"type": "object", "additionalProperties": False, "required": ["city", "zip"],
                                      "properties": {"city": {"type": "string"},
                                                     "zip": {"type": "string", "pattern": "[0-9]{5}"}}},
                          "kind": {"anyOf": [{"type": "integer"}, {"type": "null"}]}}}
PROMPTS = ["ROMEO:\n", "JULIET:\n", "First Citizen:\n", "KING HENRY:\n", "NURSE:\n", "MERCUTIO:\n", "HAMLET:\n",
           "LEAR:\n"]


def batch1(model, tokenizer, grammar, tokens: int, free_first: bool) -> tuple[float, float, int]:
    """Seconds per token (constrained, unconstrained) over the same number of new tokens."""
    ids = tokenizer.encode(PROMPTS[0])
    stop = tokenizer.eos_token_ids

    def free() -> float:
        start = time.perf_counter()
        count = sum(1 for _ in stream_generate(model, [ids], tokens))
        return (time.perf_counter() - start) / count

    unconstrained = free() if free_first else 0.0
    start = time.perf_counter()
    loop = stream_generate(model, [ids], tokens, stop_token_ids=stop, grammar=grammar)
    produced = sum(1 for _ in loop)
    constrained = (time.perf_counter() - start) / produced
    assert produced == tokens, "the schema's string is longer than --tokens: the answer is cut, never shorter"
    return constrained, unconstrained or free(), produced


def batch8(model, tokenizer, grammar, tokens: int, free_first: bool) -> tuple[float, float, int, list]:
    prompts = [tokenizer.encode(p) for p in PROMPTS]

    def run(params: SamplingParams) -> tuple[float, list]:
        engine = Engine(model, tokenizer, block_size=16)
        start = time.perf_counter()
        outs = engine.generate(prompts, params)
        return (time.perf_counter() - start) / sum(len(o.outputs[0].token_ids) for o in outs), outs

    free = SamplingParams(max_tokens=tokens, ignore_eos=True)
    unconstrained, _ = run(free) if free_first else (0.0, None)
    constrained, outs = run(SamplingParams(max_tokens=tokens, grammar=grammar))
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    assert produced == tokens * len(prompts), "the schema's string is longer than --tokens: every answer is cut"
    return constrained, unconstrained or run(free)[0], produced, outs


def mask_only(grammar, answers: list[list[int]], vocab_size: int) -> tuple[float, float]:
    """Seconds per token of mask work alone (fill + apply + advance), at batch 1 and batch len(answers)."""
    logits = np.zeros((1, vocab_size), dtype=np.float32)
    matcher = grammar.matcher()
    start = time.perf_counter()
    for token in answers[0]:
        mask_logits(logits, [matcher])
        matcher.advance(token)
    one = (time.perf_counter() - start) / len(answers[0])
    matchers = [grammar.matcher() for _ in answers]
    logits = np.zeros((len(answers), vocab_size), dtype=np.float32)
    steps, count = max(len(a) for a in answers), 0
    start = time.perf_counter()
    for step in range(steps):
        live = [m if step < len(a) else None for m, a in zip(matchers, answers)]
        mask_logits(logits, live)
        for m, a in zip(live, answers):
            if m is not None:
                m.advance(a[step])
                count += 1
    return one, (time.perf_counter() - start) / count


def compile_times(vocab, repeats: int = 5) -> tuple[float, float]:
    spec = GrammarSpec.json_schema(TYPICAL)
    cold = []
    for _ in range(repeats):
        cache = GrammarCache()
        start = time.perf_counter()
        cache.get(spec, vocab)
        cold.append(time.perf_counter() - start)
    compile_grammar(spec, vocab)
    start = time.perf_counter()
    compile_grammar(spec, vocab)
    return statistics.median(cold), time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=96, help="new tokens per answer (default 96)")
    args = ap.parse_args()
    model, tokenizer = kvlab.load()
    start = time.perf_counter()
    vocab = grammar_vocab(tokenizer, model.config.vocab_size, tokenizer.eos_token_ids)
    vocab_s = time.perf_counter() - start
    grammar = compile_grammar(GrammarSpec.json_schema(FREE_STRING), vocab)
    batch1(model, tokenizer, grammar, 8, True)  # warm-up: kernels loaded, caches touched
    r1, r8, m1, m8, times = [], [], [], [], {"c1": [], "u1": [], "c8": [], "u8": []}
    for round_ in range(args.rounds):
        c1, u1, n1 = batch1(model, tokenizer, grammar, args.tokens, free_first=round_ % 2 == 0)
        c8, u8, n8, outs = batch8(model, tokenizer, grammar, args.tokens, free_first=round_ % 2 == 1)
        one, eight = mask_only(grammar, [o.outputs[0].token_ids for o in outs], model.config.vocab_size)
        for key, value in (("c1", c1), ("u1", u1), ("c8", c8), ("u8", u8)):
            times[key].append(value)
        r1.append(c1 / u1)
        r8.append(c8 / u8)
        m1.append(one / u1)
        m8.append(eight / u8)
        print(f"round {round_}: batch 1 {1e3 * c1:.3f} vs {1e3 * u1:.3f} ms/token ({n1} tokens, x{c1 / u1:.3f}); "
              f"batch 8 {1e3 * c8:.3f} vs {1e3 * u8:.3f} ms/token ({n8} tokens, x{c8 / u8:.3f}); mask alone "
              f"{1e3 * one:.3f} / {1e3 * eight:.3f} ms/token")
    cold, hit = compile_times(vocab)
    print()
    print("| measure (shipped 3.3M model, median of rounds) | value |")
    print("| --- | --- |")
    print(f"| batch 1: constrained / unconstrained time per token, median of rounds' ratios | "
          f"{statistics.median(r1):.3f} |")
    print(f"| batch 1: the same, best round of each | {min(times['c1']) / min(times['u1']):.3f} "
          f"({1e3 * min(times['c1']):.3f} / {1e3 * min(times['u1']):.3f} ms) |")
    print(f"| batch 8: constrained / unconstrained time per token, median of rounds' ratios | "
          f"{statistics.median(r8):.3f} |")
    print(f"| batch 8: the same, best round of each | {min(times['c8']) / min(times['u8']):.3f} "
          f"({1e3 * min(times['c8']):.3f} / {1e3 * min(times['u8']):.3f} ms) |")
    print(f"| mask alone (fill + apply + advance) / unconstrained token, batch 1 | {statistics.median(m1):.3f} |")
    print(f"| mask alone / unconstrained token, batch 8 | {statistics.median(m8):.3f} |")
    print(f"| compile a typical schema (cold, median of 5) | {1e3 * cold:.2f} ms |")
    print(f"| compile it again (LRU hit) | {1e6 * hit:.1f} us |")
    print(f"| build the vocabulary for llguidance (once per tokenizer) | {1e3 * vocab_s:.1f} ms |")


if __name__ == "__main__":
    main()
