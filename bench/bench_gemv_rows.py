"""The float products (kernels/gemv.py over kernels/fdot.py) at 1..16 rows of x, one thread, GFLOP/s.

What a decode step, a batch and a speculative verification (k + 1 rows) ask of the float kernels:
x [M, K] float32 times W [N, K] float32, float16 or bfloat16 as stored. The matrix is small enough to
stay in L2, so the figure is the kernel's arithmetic rate (the call included), not memory's. Timed in
thread CPU time (time.thread_time: a neighbour's load on a shared VM does not count), best of --repeats.
With --old, the same in a second tree, each tree in its own process, alternating round by round; prints
the median of the per-round ratios new/old per cell.

    python bench/bench_gemv_rows.py [--dtypes float32 float16 bfloat16] [--shape 1536 512] [--rows 1 4 8 16]
    git worktree add /tmp/kvlab-old <commit>; python bench/bench_gemv_rows.py --old /tmp/kvlab-old --rounds 3
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from two_trees import add_arguments, compare, run_worker  # noqa: E402

HERE = Path(__file__).resolve().parent.parent
WORKER = r'''
import json, sys, time
import numba
import numpy as np
from kvlab.kernels import gemv
from kvlab.kernels.bits import BFLOAT16, as_kernel_array
numba.set_num_threads(1)
dtypes, (n, k), rows, repeats = json.loads(sys.argv[1])
rng = np.random.default_rng(0)
result = {}
for name in dtypes:
    w = as_kernel_array(rng.standard_normal((n, k)).astype(BFLOAT16 if name == "bfloat16" else name))
    for m in rows:
        x = rng.standard_normal((m, k)).astype(np.float32)
        out = np.empty((m, n), np.float32)
        zero = np.float32(0)
        gemv._matvec(x, w, out, zero)  # compile
        calls = max(20, 400 // m)
        best = float("inf")
        for _ in range(repeats):
            start = time.thread_time()
            for _ in range(calls):
                gemv._matvec(x, w, out, zero)
            best = min(best, (time.thread_time() - start) / calls)
        result[f"{name} M={m}"] = 2 * m * n * k / best / 1e9
print(json.dumps(result))
'''


def run(tree: Path, args: argparse.Namespace) -> dict[str, float]:
    """GFLOP/s per cell, measured in `tree` in a fresh process."""
    return run_worker(WORKER, tree, json.dumps([args.dtypes, args.shape, args.rows, args.repeats]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtypes", nargs="+", default=["float32", "float16", "bfloat16"])
    add_arguments(p, [1, 2, 4, 6, 8, 16])
    args = p.parse_args()
    compare(args, HERE, lambda tree: run(tree, args), "GFLOP/s", 14)


if __name__ == "__main__":
    main()
