"""Small-batch products on one thread: one column at a time (8-row blocks) vs 4x2 register tiles, GFLOP/s.

The batched decode's products (kvlab/kernels/gemv.py) take rows of x against rows of W. Column by column
(`matvec_column`: 8 rows of x per row of W) each loaded vector of W feeds 8 multiply-adds but every
column re-reads x; the tiles (`matvec_block` from TILE_MIN_ROWS rows) load 2 vectors of W and 4 of x per
8 multiply-adds over blocks of columns sized for L2. Here both run over the same matrix, small enough
to stay in cache (so the figure is the kernel's arithmetic rate, not the memory's), alternating, one
thread, best of --repeats; outputs are checked equal to float32 rounding.

    python bench/bench_gemv_tiles.py [--shape 64 576] [--rows 4 8 16] [--repeats 5]
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
from numba import njit  # noqa: E402

from kvlab.kernels import gemv  # noqa: E402
from kvlab.kernels.bits import BFLOAT16, as_kernel_array  # noqa: E402


@njit(fastmath=gemv.FASTMATH)
def by_column(x, w, out, zero, reps):
    for _ in range(reps):
        for n in range(w.shape[0]):
            gemv.matvec_column(x, w, out, zero, n)


@njit(fastmath=gemv.FASTMATH)
def by_tile(x, w, out, zero, reps):
    for _ in range(reps):
        gemv.matvec_block(x, w, out, zero, 0, w.shape[0])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", type=int, nargs=2, default=[64, 576], help="W's rows and columns")
    p.add_argument("--rows", type=int, nargs="+", default=[8, 16])
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    (n, k), reps = args.shape, 200
    rng = np.random.default_rng(0)
    print(f"W [{n}, {k}], one thread, GFLOP/s (best of {args.repeats})")
    for name, dtype in (("f32", np.float32), ("bf16", BFLOAT16)):
        w = as_kernel_array(rng.standard_normal((n, k)).astype(dtype))
        for rows in args.rows:
            if rows < gemv.TILE_MIN_ROWS:
                raise SystemExit(f"--rows must be at least TILE_MIN_ROWS = {gemv.TILE_MIN_ROWS}")
            x = rng.standard_normal((rows, k)).astype(np.float32)
            outs = {f: np.empty((rows, n), np.float32) for f in (by_column, by_tile)}
            best = {}
            for f, out in outs.items():
                f(x, w, out, np.float32(0), 1)
            assert np.abs(outs[by_column] - outs[by_tile]).max() <= 1e-5 * k
            for r in range(args.repeats):
                for f in (outs if r % 2 else list(outs)[::-1]):
                    start = time.perf_counter()
                    f(x, w, outs[f], np.float32(0), reps)
                    best[f] = min(best.get(f, np.inf), (time.perf_counter() - start) / reps)
            rate = {f: 2 * rows * n * k / t / 1e9 for f, t in best.items()}
            print(f"  {name:4s} {rows:2d} rows: by column {rate[by_column]:6.1f}  tiles {rate[by_tile]:6.1f}  "
                  f"({rate[by_tile] / rate[by_column]:.2f}x)")


if __name__ == "__main__":
    main()
