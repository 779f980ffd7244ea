"""What one compiled call costs when the caches are cold, as in a decode step: warm vs after a sweep.

A decode step calls the compiled kernels layer by layer (the fused qkv+RoPE, attention, the fused
output+MLP: ~90 calls for 30 layers), and between two calls the weight products stream megabytes
through the caches (SmolLM2-135M: ~18 MB a layer in float32, 3–5 MB as Q4/Q8 blocks). This times:

  * an empty numba function of 15 arguments (the decode-attention kernel's count): the dispatcher alone;
  * the serial decode-attention kernel on 1 and 128 keys (3 KV heads x 3 query heads, d 64);

each warm (called back to back) and after sweeping `--sweep` MB (a NumPy sum over a fresh array, like a
layer's weight stream), best of `--rounds`. The difference is what a call pays in cache and TLB misses on
its code, its arguments' Python objects and its data: the per-call cost a step pays ~90 times.

With `--model FILE.gguf`, one more row: an empty numba function given a real one-call decode block's
arguments (kernels/decode_block.py: 18 arguments, the weights as nested tuples of arrays, as a decode step
of that model passes them, captured from one step): what the dispatcher's typing and unboxing cost each of
a step's blocks (one a layer) before any arithmetic.

    PYTHONPATH=. python bench/bench_call_overhead.py [--sweep 4 18 64] [--rounds 30] [--model FILE.gguf]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("NUMBA_NUM_THREADS", "2")

os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "12")  # kvlab's default (kvlab/__init__.py): before NumPy loads OpenBLAS
import numpy as np  # noqa: E402
from numba import njit  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from kvlab.kernels import attention  # noqa: E402


@njit
def _empty(a, b, c, d, e, f, g, h, i, j, k, l, m, n, o):  # noqa: E741 - fifteen arguments, as the kernel's
    return 0


@njit
def _empty18(a, b, c, d, e, f, g, h, i, j, k, l, m, n, o, p, q, r):  # noqa: E741 - decode_block's eighteen
    return 0


def decode_block_arguments(path: str) -> tuple[tuple, int]:
    """The arguments of the first one-call block of a decode step of the model at `path` (its default
    mode), captured from the ops, and how many leaves (arrays and scalars) they hold."""
    import kvlab

    model, tokenizer = kvlab.load(path)
    captured: list[tuple] = []
    block = model.ops._decode_block
    model.ops._decode_block = lambda *a: (captured.append(a), block(*a))[1]
    cache = model.new_cache(1)
    model.forward(np.array([tokenizer.encode("The quick brown fox")]), cache=cache)
    captured.clear()
    model.forward(np.array([[5]]), cache=cache)
    model.ops._decode_block = block
    if not captured:
        raise SystemExit(f"{path}: its decode step makes no one-call block (a float64 model, or fusion off)")

    def leaves(x) -> int:
        return sum(leaves(y) for y in x) if isinstance(x, tuple) else 1

    return captured[0], leaves(captured[0])


def best_us(call, prepare, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        prepare()
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return 1e6 * best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sweep", type=float, nargs="+", default=[4, 18, 64], help="MB streamed between calls")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--model", help="a GGUF file: time the dispatch of its decode block's real arguments")
    args = p.parse_args()
    rng = np.random.default_rng(0)
    keys, values = (rng.standard_normal((1, 3, 256, 64)).astype(np.float32) for _ in range(2))
    q = attention._scaled(rng.standard_normal((1, 9, 64)).astype(np.float32), None)
    out = np.empty_like(q)
    kc, ks, kz, kind, group = attention.kernel_operands(keys)
    vc, vs, vz, _, _ = attention.kernel_operands(values)
    tables, starts = np.zeros((1, 1), np.int64), np.zeros(1, np.int64)
    kernel = attention.decode_kernel(0)  # the serial kernel: what a short context runs

    def decode(length: int):
        ends = np.full(1, length, np.int64)
        return lambda: kernel(q, kc, ks, kz, vc, vs, vz, kind, group, tables, starts, ends, attention.SPAN, 2, out,
                              np.float32(0))

    calls = {"empty njit, 15 args": lambda: _empty(q, kc, ks, kz, vc, vs, vz, kind, group, tables, starts,
                                                   starts, 1, out, np.float32(0)),
             "decode attention, 1 key": decode(1), "decode attention, 128 keys": decode(128)}
    if args.model:
        block_args, leaves = decode_block_arguments(args.model)
        calls[f"empty njit, a block's {leaves} arrays"] = lambda: _empty18(*block_args)
    for call in calls.values():
        call()
    sweeps = {mb: np.ones(int(mb * 2**20) // 4, np.float32) for mb in args.sweep}
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown CPU")
    print(f"{cpu}; best of {args.rounds}; microseconds a call")
    print(f"{'call':<28}{'warm':>8}" + "".join(f"{f'after {mb:g} MB':>14}" for mb in args.sweep))
    for name, call in calls.items():
        warm = best_us(call, lambda: None, args.rounds)
        cold = [best_us(call, sweeps[mb].sum, args.rounds) for mb in args.sweep]
        print(f"{name:<28}{warm:>8.1f}" + "".join(f"{c:>14.1f}" for c in cold))


if __name__ == "__main__":
    main()
