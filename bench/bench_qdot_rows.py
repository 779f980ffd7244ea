"""The int8-activation product (kernels/qdot.py) at 1..16 rows of x, one thread, G multiply-adds/s.

What batched decode, speculative verification (k + 1 rows) and short prefills ask of the integer kernels:
x [M, K] rounded to int8 per group and multiplied by a block-quantized W [N, K] kept as stored. The
matrix is small enough to stay in L2, so the figure is the kernel's arithmetic rate (rounding of x and
the call included), not memory's. Timed in thread CPU time (time.thread_time: a neighbour's load on a
shared VM does not count), best of --repeats. With --old, the same in a second tree, each tree in its own
process, alternating round by round; prints the median of the per-round ratios new/old per cell.

    python bench/bench_qdot_rows.py [--types Q8_0 Q4_0 Q4_K Q6_K] [--shape 1536 512] [--rows 1 2 4 8 16]
    git worktree add /tmp/kvlab-old <commit>; python bench/bench_qdot_rows.py --old /tmp/kvlab-old --rounds 3
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
sys.path.insert(0, sys.argv[1] + "/tests")
from gguf_files import blocks
from kvlab.model.quantized import QuantizedMatrix
numba.set_num_threads(1)
types, (n, k), rows, repeats = json.loads(sys.argv[2])
rng = np.random.default_rng(0)
result = {}
for type_name in types:
    matrix = QuantizedMatrix.from_blocks(type_name, blocks(type_name, n, k, rng, "normal"), (n, k))
    for m in rows:
        x = rng.standard_normal((m, k)).astype(np.float32)
        matrix.matmul_t(x, True, "q8")  # compile, and the dot layout made
        calls = max(20, 400 // m)
        best = float("inf")
        for _ in range(repeats):
            start = time.thread_time()
            for _ in range(calls):
                matrix.matmul_t(x, True, "q8")
            best = min(best, (time.thread_time() - start) / calls)
        result[f"{type_name} M={m}"] = m * n * k / best / 1e9
print(json.dumps(result))
'''


def run(tree: Path, args: argparse.Namespace) -> dict[str, float]:
    """G multiply-adds/s per cell, measured in `tree` in a fresh process."""
    return run_worker(WORKER, tree, str(tree), json.dumps([args.types, args.shape, args.rows, args.repeats]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--types", nargs="+", default=["Q8_0", "Q4_0", "Q4_K", "Q6_K"])
    add_arguments(p, [1, 2, 4, 8, 16])
    args = p.parse_args()
    compare(args, HERE, lambda tree: run(tree, args), "G multiply-adds/s", 12)


if __name__ == "__main__":
    main()
