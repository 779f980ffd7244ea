"""A 10,000-token conversation on an 8k-context model in a pool sized for 2,048 tokens (issue 21's goal).

A random model of SmolLM2-135M's shape (float32, context 8192) runs one conversation of `--tokens`
tokens (a prompt plus `--new` greedy tokens) through the paged engine with a cache policy, in a pool of
`--pool-tokens` tokens. Measured: the most blocks the sequence and the pool held (against the bound and
the pool), the engine's wall time, and, replaying the engine's chunk schedule on the contiguous reference
cache under the same policy done by hand (PolicyCache, kvlab/verify/policy_reference.py: kept keys moved to
positions 0..k-1 and re-rotated, the engine's convention being text positions), the largest logit
difference and whether every greedy token equals the reference's argmax. The plain engine refuses the same
conversation (it outgrows the context and the pool). Timings on a shared machine are noisy: compare the
two times of one run, not runs.

    python bench/bench_engine_policy.py [--policy sinks:4:2012] [--tokens 10000] [--new 64] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import os
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "12")  # kvlab's default (kvlab/__init__.py): before NumPy loads OpenBLAS
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvlab import Engine, SamplingParams  # noqa: E402
from kvlab.config import ModelConfig  # noqa: E402
from kvlab.engine.kv_bounds import held_blocks  # noqa: E402
from kvlab.errors import KVLabError  # noqa: E402
from kvlab.model.llama import LlamaModel  # noqa: E402
from kvlab.policies import parse_policy  # noqa: E402
from kvlab.verify.policy_reference import PolicyCache  # noqa: E402

from shapes import SMOLLM2_135M  # noqa: E402 (bench/shapes.py)

SHAPE = SMOLLM2_135M


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--policy", action="append", default=None, help="repeatable (default sinks:4:2012 and "
                   "window:2032, the largest that fit 2048 tokens of 16-token blocks)")
    p.add_argument("--tokens", type=int, default=10_000, help="conversation length, prompt + new tokens")
    p.add_argument("--new", type=int, default=64, help="greedy tokens generated at the end")
    p.add_argument("--pool-tokens", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--chunk", type=int, default=512, help="max_num_batched_tokens")
    p.add_argument("--no-reference", action="store_true", help="skip the contiguous replay")
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args()


def run_engine(model, policy: str, prompt: list[int], args) -> dict:
    engine = Engine(model, block_size=args.block_size, num_blocks=args.pool_tokens // args.block_size,
                    max_num_batched_tokens=args.chunk, kv_policy=policy)
    chunks, held, used = [], 0, 0
    inner = engine.runner.run

    def run(scheduled):
        nonlocal held, used
        [(seq, n)] = scheduled
        start = seq.num_computed_tokens
        held = max(held, len(held_blocks(seq)))
        logits, sampled = inner(scheduled)
        used = max(used, engine.block_pool.num_used_blocks)
        engine.block_pool.check_invariants()
        chunks.append((start, n, logits[0].copy() if sampled else None))
        return logits, sampled

    engine.runner.run = run
    begin = time.perf_counter()
    [out] = engine.generate([prompt], SamplingParams(max_tokens=args.new, ignore_eos=True))
    seconds = time.perf_counter() - begin
    bound = engine.bounds.max_blocks(args.tokens)
    return {"policy": policy, "engine_seconds": round(seconds, 1), "max_blocks_held": held,
            "max_pool_blocks_used": used, "bound_blocks": bound, "pool_blocks": engine.block_pool.num_blocks,
            "steps": len(chunks), "tokens": out.prompt_token_ids + out.outputs[0].token_ids,
            "chunks": chunks, "preemptions": engine.stats()["num_preemptions"]}


def replay_contiguous(model, policy_text: str, result: dict) -> dict:
    """The engine's chunks under the same policy by hand: max |logit diff|, tokens equal."""
    policy = parse_policy(policy_text, model.config.max_position_embeddings)
    cache = PolicyCache(model, policy)
    tokens, worst, scale, agree, total = result["tokens"], 0.0, 0.0, 0, 0
    begin = time.perf_counter()
    for start, n, engine_logits in result["chunks"]:
        logits = cache.feed(tokens[start:start + n], chunk=n, logits_to_keep=1)[-1]
        if engine_logits is not None:
            worst = max(worst, float(np.abs(engine_logits - logits).max()))
            scale = max(scale, float(np.abs(logits).max()))
            total += 1
            agree += int(np.argmax(engine_logits)) == int(np.argmax(logits))
    return {"contiguous_seconds": round(time.perf_counter() - begin, 1), "max_abs_logit_diff": worst,
            "max_abs_logit": scale, "greedy_tokens_equal": f"{agree}/{total}"}


def main() -> None:
    args = parse_args()
    model = LlamaModel(ModelConfig(**SHAPE), seed=0, dtype=np.float32)
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(1, SHAPE["vocab_size"], args.tokens - args.new)]
    try:
        Engine(model, block_size=args.block_size, num_blocks=args.pool_tokens // args.block_size,
               max_num_batched_tokens=args.chunk).add_request("exact", prompt)
        refusal = None
    except KVLabError as exc:
        refusal = f"{type(exc).__name__}: {exc}"
    rows = []
    for policy in args.policy or ["sinks:4:2012", "window:2032"]:
        result = run_engine(model, policy, prompt, args)
        if not args.no_reference:
            result.update(replay_contiguous(model, policy, result))
        del result["chunks"], result["tokens"]
        rows.append(result)
        print(json.dumps(result), flush=True)
    report = {"model": "SmolLM2-135M shape, random weights, float32, context 8192",
              "conversation_tokens": args.tokens, "pool_tokens": args.pool_tokens, "block_size": args.block_size,
              "max_num_batched_tokens": args.chunk, "exact_engine": refusal, "rows": rows}
    print(json.dumps({k: v for k, v in report.items() if k != "rows"}))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
