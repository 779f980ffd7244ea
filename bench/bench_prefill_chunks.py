"""Prefill chunks of several sequences: one varlen kernel call vs one call per sequence, side by side.

An engine step may hold prefill chunks of several requests, each its own length and cached prefix. The
compiled PagedAttention used to attend them sequence by sequence; now every chunk goes into one
`varlen_prefill_attention` call (work items over query tiles of every sequence x KV heads). This times
both on SmolLM2-135M's attention shape (9 query heads, 3 KV heads, d 64) over a shuffled float32 block
pool, alternating round by round, and checks that they agree.

    python bench/bench_prefill_chunks.py [--seqs 8] [--chunk 64] [--cached 0 512] [--rounds 20]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import os
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "12")  # kvlab's default (kvlab/__init__.py): before NumPy loads OpenBLAS
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's kvlab
from kvlab.kernels import prefill_attention  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqs", type=int, default=8)
    p.add_argument("--chunk", type=int, nargs=2, default=[16, 96], help="chunk lengths drawn from this range")
    p.add_argument("--cached", type=int, nargs=2, default=[0, 512], help="cached prefixes drawn from this range")
    p.add_argument("--rounds", type=int, default=20)
    args = p.parse_args()
    rng = np.random.default_rng(0)
    heads, kv_heads, d, block = 9, 3, 64, 16
    new = rng.integers(args.chunk[0], args.chunk[1] + 1, args.seqs)
    cached = rng.integers(args.cached[0], args.cached[1] + 1, args.seqs)
    counts = -(-(new + cached) // block)
    order = rng.permutation(int(counts.sum()))
    tables = np.zeros((args.seqs, counts.max()), dtype=np.int64)
    at = 0
    for s, c in enumerate(counts):
        tables[s, :c], at = order[at:at + c], at + c
    k_blocks = rng.standard_normal((int(counts.sum()), kv_heads, block, d)).astype(np.float32)
    v_blocks = rng.standard_normal(k_blocks.shape).astype(np.float32)
    q = rng.standard_normal((int(new.sum()), heads, d)).astype(np.float32)
    starts = np.concatenate([[0], np.cumsum(new)])
    lo = np.zeros(int(new.sum()), dtype=np.int64)
    hi = np.concatenate([c + np.arange(1, n + 1) for c, n in zip(cached, new)])  # causal

    def together() -> np.ndarray:
        return prefill_attention.varlen_prefill_attention(q, k_blocks, v_blocks, tables, starts, lo, hi)

    def one_by_one() -> np.ndarray:
        out = np.empty_like(q)
        for s in range(args.seqs):
            rows = slice(starts[s], starts[s + 1])
            out[rows] = prefill_attention.varlen_prefill_attention(
                q[rows], k_blocks, v_blocks, tables[s:s + 1], np.array([0, new[s]]), lo[rows], hi[rows])
        return out

    assert np.abs(together() - one_by_one()).max() <= 1e-5
    runs = {"one call": together, "per sequence": one_by_one}
    best = {name: float("inf") for name in runs}
    for r in range(args.rounds):
        for name in (list(runs) if r % 2 else list(runs)[::-1]):  # swap who goes first each round
            fn = runs[name]
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    print(f"{args.seqs} chunks of {new.min()}..{new.max()} tokens after {cached.min()}..{cached.max()} cached; "
          f"best of {args.rounds} alternating rounds")
    for name, t in best.items():
        print(f"  {name:13s} {1e3 * t:8.2f} ms")
    print(f"  per sequence / one call: {best['per sequence'] / best['one call']:.2f}x")


if __name__ == "__main__":
    main()
