"""The quantized products at 1..16 rows of x, G multiply-adds/s: the int8-activation kernels (kernels/qdot.py)
or, with `--activations float32`, the exact ones (kernels/qsimd.py).

What batched decode, speculative verification (k + 1 rows) and short prefills ask of the kernels:
x [M, K] (rounded to int8 per group in the q8 mode) times a block-quantized W [N, K] kept as stored. At
the default shape the matrix stays in L2, so the figure is the kernel's arithmetic rate (the call
included), not memory's. On one thread (the default) it is timed in thread CPU time (time.thread_time: a
neighbour's load on a shared VM does not count); with `--threads 2` in wall time, which with a model-sized
`--shape 8192 2048` is what a decode step's product streams from memory. Best of --repeats. With --old,
the same in a second tree, each tree in its own process, alternating round by round; prints the median of
the per-round ratios new/old per cell.

    python bench/bench_qdot_rows.py [--types Q8_0 Q4_0 Q4_K Q6_K] [--shape 1536 512] [--rows 1 2 4 8 16]
        [--activations q8|float32] [--threads 1]
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
types, (n, k), rows, repeats, activations, threads = json.loads(sys.argv[2])
numba.set_num_threads(threads)
clock = time.thread_time if threads == 1 else time.perf_counter
rng = np.random.default_rng(0)
result = {}
for type_name in types:
    matrix = QuantizedMatrix.from_blocks(type_name, blocks(type_name, n, k, rng, "normal"), (n, k))
    for m in rows:
        x = rng.standard_normal((m, k)).astype(np.float32)
        matrix.matmul_t(x, True, activations)  # compile, and the mode's layout made
        calls = max(20, 400 // m)
        best = float("inf")
        for _ in range(repeats):
            start = clock()
            for _ in range(calls):
                matrix.matmul_t(x, True, activations)
            best = min(best, (clock() - start) / calls)
        result[f"{type_name} M={m}"] = m * n * k / best / 1e9
print(json.dumps(result))
'''


def run(tree: Path, args: argparse.Namespace) -> dict[str, float]:
    """G multiply-adds/s per cell, measured in `tree` in a fresh process."""
    return run_worker(WORKER, tree, str(tree), json.dumps([args.types, args.shape, args.rows, args.repeats,
                                                           args.activations, args.threads]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--types", nargs="+", default=["Q8_0", "Q4_0", "Q4_K", "Q6_K"])
    p.add_argument("--activations", choices=["q8", "float32"], default="q8",
                   help="q8: x rounded to int8, integer kernels; float32: the exact kernels")
    p.add_argument("--threads", type=int, default=1, help="numba threads (more than one: timed in wall time)")
    add_arguments(p, [1, 2, 4, 8, 16])
    args = p.parse_args()
    compare(args, HERE, lambda tree: run(tree, args), "G multiply-adds/s", 12)


if __name__ == "__main__":
    main()
