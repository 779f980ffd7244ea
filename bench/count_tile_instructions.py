"""The vector instructions in one compiled integer tile kernel (kernels/qdot.py's tile_dot_R), counted from
its assembly: what a kernel change does to the instructions per group, where timings are too noisy to tell.

Compiles `tile_dot_R` for R rows of x against a small matrix of each type on this CPU's path (VNNI, AVX2's
`vpmaddubsw`, or the generic IR) and prints, per type, the count of each instruction named. With `--tree`,
the kernels of another kvlab checkout (e.g. a `git worktree` of an older commit) instead of this one.

    python bench/count_tile_instructions.py [--types Q4_0 Q8_0] [--rows 4] [--tree PATH]
        [--ops vpmaddubsw vpmaddwd vpaddd vpaddw vpsignb vpdpbusd]
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--types", nargs="+", default=["Q4_0", "Q8_0"])
    p.add_argument("--rows", type=int, default=4, choices=[1, 2, 3, 4, 8])
    p.add_argument("--tree", type=Path, default=Path(__file__).resolve().parent.parent)
    p.add_argument("--ops", nargs="+", default=["vpmaddubsw", "vpmaddwd", "vpaddd", "vpaddw", "vpsignb", "vpdpbusd"])
    args = p.parse_args()
    sys.path[:0] = [str(args.tree), str(args.tree / "tests")]
    import numpy as np
    from numba import njit

    from gguf_files import blocks
    from kvlab.kernels import qdot
    from kvlab.kernels.qgemv import round_rows
    from kvlab.model.quantized import QuantizedMatrix

    tile = getattr(qdot, f"tile_dot_{args.rows}")

    @njit  # not cached: one compile per type, its assembly read back
    def first_tile(xq, dx, qbias, fsum, codes, scales, offsets, base_scales, base_offsets, out):
        tile(xq, 0, dx, qbias, fsum, codes, scales, offsets, base_scales, base_offsets, 0, out)

    rng = np.random.default_rng(0)
    path = "vnni" if qdot.VNNI else "avx2 (vpmaddubsw)" if getattr(qdot, "MADD", False) else "generic"
    print(f"tile_dot_{args.rows} from {args.tree}, path: {path}")
    for type_name in args.types:
        matrix = QuantizedMatrix.from_blocks(type_name, blocks(type_name, 8, 256, rng, "normal"), (8, 256))
        x = rng.standard_normal((args.rows, 256)).astype(np.float32)
        layout = matrix.dot_layout
        first_tile(*round_rows(x, matrix.group, layout[3]), *layout[:3], *layout[4:],
                   np.empty((args.rows, 8), dtype=np.float32))
        asm = first_tile.inspect_asm(first_tile.signatures[-1])
        counts = {op: len(re.findall(rf"^\s+{op}\b", asm, re.M)) for op in args.ops}
        print(f"{type_name:6s} " + "  ".join(f"{op} {n}" for op, n in counts.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
