"""Decode attention alone, per cache dtype: the compiled kernel's read rate against the streaming read.

One layer of SmolLM2-135M's shape (3 KV heads of 64, 9 query heads), one sequence, `--contexts` keys in
each cache dtype (float rows, or int8/int4/fp8 codes with their scales, as the stores hold them). Every
dtype is timed in interleaved rounds with the single-threaded and the parallel kernel (split-K over the
threads), best of the rounds; the table gives microseconds a call, nanoseconds per key row (one key of one
KV head, for its G query heads), the K/V bytes read over the time, and the time over the bytes' roofline
(the streaming-read bandwidth of bench/roofline.py, measured in the same run). Each call is made once more
right after, its K/V then still in cache ("cached ns/row": the kernel's arithmetic without DRAM). And
"tile fill ns/row": of that, the share that widens or dequantizes rows into the kernel's float32 tiles
(the kernel's own `_tile` over every key and value tile, one thread, cached; 0 for float32, read in place).

    PYTHONPATH=. python bench/bench_decode_attention.py [--threads 2] [--contexts 1024 4096] [--rounds 30]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--dtypes", nargs="+",
                   default=["float32", "bfloat16", "float16", "int8", "int4", "fp8_e4m3", "fp8_e5m2"])
    return p.parse_args()


ARGS = parse_args()
os.environ["NUMBA_NUM_THREADS"] = str(ARGS.threads)

os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "12")  # kvlab's default (kvlab/__init__.py): before NumPy loads OpenBLAS
import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from kvlab.cache.dtypes import resolve_kv_dtype  # noqa: E402
from kvlab.cache.quant import encode_rows  # noqa: E402
from kvlab.kernels import attention  # noqa: E402
from numba import njit  # noqa: E402
from kvlab.kernels.attention_formats import StoredCodes, kind_of  # noqa: E402
from kvlab.kernels.bits import BFLOAT16  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from roofline import measure_bandwidth  # noqa: E402

KV_HEADS, GROUP, HEAD_DIM = 3, 3, 64


def _fill_tiles_py(kc, ks, kz, vc, vs, vz, kind, group, rows, k_tile, v_tile, zero):
    """What the kernel does to K and V before its products: every tile of every KV head widened or
    dequantized into float32 scratch (`attention._tile`), no products."""
    for h in range(kc.shape[1]):
        r = 0
        while r < rows:
            n = min(attention.TILE, rows - r)
            attention._tile(kc, ks, kz, kind, group, 0, h, r, n, k_tile, zero)
            attention._tile(vc, vs, vz, kind, group, 0, h, r, n, v_tile, zero)
            r += n


_fill_tiles = njit(fastmath=attention.FASTMATH)(_fill_tiles_py)  # compiled once per signature


def tile_fill_seconds(keys, values, rows: int, reps: int = 5) -> float:
    """Best time of `_fill_tiles_py` over one layer's K/V, called twice a rep (the second one timed)."""
    fill = _fill_tiles
    kc, ks, kz, kind, group = attention.kernel_operands(keys)
    vc, vs, vz, _, _ = attention.kernel_operands(values)
    tiles = np.empty((2, 1, 1, attention.TILE, HEAD_DIM), np.float32)
    best = float("inf")
    for _ in range(reps + 1):
        fill(kc, ks, kz, vc, vs, vz, kind, group, rows, tiles[0], tiles[1], np.float32(0))
        start = time.perf_counter()
        fill(kc, ks, kz, vc, vs, vz, kind, group, rows, tiles[0], tiles[1], np.float32(0))
        best = min(best, time.perf_counter() - start)
    return best


def stored(x: np.ndarray, name: str) -> tuple[object, int]:
    """x in cache dtype `name` and the bytes it holds (scales included)."""
    if name in ("float32", "float16", "bfloat16"):
        rows = x.astype(BFLOAT16 if name == "bfloat16" else np.dtype(name))
        return rows, rows.nbytes
    fmt = resolve_kv_dtype(name, np.float32)
    codes, scale, zero = encode_rows(x, fmt, fmt.group(HEAD_DIM))
    if scale is None:
        scale = zero = np.zeros(x.shape[:3] + (0,), np.float16)
    return StoredCodes(codes, scale, zero, kind_of(name), fmt.group(HEAD_DIM)), codes.nbytes + 2 * scale.nbytes


def main() -> None:
    rng = np.random.default_rng(0)
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown CPU")
    print(f"decode attention, one layer of SmolLM2-135M's shape (3 KV heads x 3 query heads, d 64), {cpu}, "
          f"{ARGS.threads} threads; best of {ARGS.rounds} interleaved rounds; load average "
          f"{os.getloadavg()[0]:.1f} (a shared machine: compare rows of one run)")
    print(f"{'context':>7} {'cache':>9} {'kernel':>8} {'us':>7} {'ns/row':>7} {'GB/s':>6} {'x roof':>7} "
          f"{'cached ns/row':>14} {'tile fill ns/row':>17}")
    for context in ARGS.contexts:
        shape = (1, KV_HEADS, context, HEAD_DIM)
        x_k, x_v = rng.standard_normal(shape, dtype=np.float32), rng.standard_normal(shape, dtype=np.float32)
        q = rng.standard_normal((1, KV_HEADS * GROUP, HEAD_DIM)).astype(np.float32)
        cases = {}
        for name in ARGS.dtypes:
            (keys, k_bytes), (values, v_bytes) = stored(x_k, name), stored(x_v, name)
            cases[name] = (keys, values, k_bytes + v_bytes)
        fill = {name: tile_fill_seconds(keys, values, context) for name, (keys, values, _) in cases.items()}
        best = {(name, kind): float("inf") for name in cases for kind in ("serial", "parallel")}
        cached = dict(best)  # the same call again at once: the layer's K/V (a few MB) still in cache
        bandwidth = 0.0
        for r in range(ARGS.rounds):
            if r % 10 == 0:
                bandwidth = max(bandwidth, measure_bandwidth(2))
            for (name, kind) in best:
                keys, values, _ = cases[name]
                attention.PARALLEL_MIN_ROWS = 10**12 if kind == "serial" else 0
                for table in (best, cached):
                    start = time.perf_counter()
                    attention.decode_attention(q, keys, values, 0, context)
                    table[(name, kind)] = min(table[(name, kind)], time.perf_counter() - start)
        for (name, kind), seconds in best.items():
            nbytes = cases[name][2]
            print(f"{context:>7} {name:>9} {kind:>8} {1e6 * seconds:>7.0f} {1e9 * seconds / (KV_HEADS * context):>7.1f} "
                  f"{nbytes / seconds / 1e9:>6.1f} {seconds / (nbytes / bandwidth):>6.2f}x "
                  f"{1e9 * cached[(name, kind)] / (KV_HEADS * context):>14.1f} "
                  f"{1e9 * fill[name] / (KV_HEADS * context) if kind == 'serial' else float('nan'):>17.1f}")
    print(f"streaming read (same run): {bandwidth / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()
