"""The integer products' arithmetic peak on this CPU: kernels/qdot.py's own instructions in registers, no memory.

What bounds batched decode (issue 37's "batch 16 >= 6x batch 1") once the weights are read once for many rows
is the multiply-adds a tile kernel can issue. This bench builds a loop of exactly the instructions
`tile_dot_R`'s inner loop issues per 32-byte load of codes (`qdot._dpbusd`: vpdpbusd where VNNI, else
vpmaddubsw + vpmaddwd, 8-bit codes by the sign trick, nibbles split and summed in 16 bits where `nibble_pairs`
says so), for `--rows` rows of x with two loads a step as the kernel unrolls, each row's four activations
broadcast from memory as the kernel does (`vpbroadcastd`, from a small array in L1), but the codes made in
registers (one byte add a step, so nothing is hoisted): no loads of codes, no per-group epilogue
(conversion, scales), no loop over tiles. Its G multiply-adds/s is an upper bound for
`bench/bench_qdot_rows.py`'s figure for the same type and rows (one thread, thread CPU time, best of
--repeats); their ratio says how much of the kernel's time goes to what is not arithmetic.

    python bench/bench_int_peak.py [--rows 4] [--repeats 7]
    python bench/bench_qdot_rows.py --types Q8_0 Q4_0 --rows 4 16     # the kernels' rate, beside it
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numba
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from kvlab.kernels import qdot
from kvlab.kernels.layout import LANES, QUAD

_I8, _I16, _I32, _I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
_V32I8 = ir.VectorType(_I8, LANES * QUAD)
_V8I32 = ir.VectorType(_I32, LANES)
_V16I16 = ir.VectorType(_I16, 2 * LANES)
LOADS = qdot.UNROLL  # 32-byte loads of codes a step, as the kernel's quad loop


def _make_peak(rows: int, nibbles: bool):
    """A compiled loop of `steps` steps, each the products of LOADS loads of codes for `rows` rows of x,
    returning the accumulators' sum (so the loop is live)."""
    accs = 1 if rows >= 8 else 2
    pairs = qdot.nibble_pairs(accs, nibbles, False)
    sign_trick = qdot.MADD and not nibbles

    @intrinsic
    def peak(typingctx, steps, xs):
        sig = types.int64(steps, xs)

        def codegen(context, builder, signature, args):
            n, xa = args
            x_data = cgutils.create_struct_proxy(signature.args[1])(context, builder, value=xa).data
            zero = ir.Constant(_V16I16 if pairs else _V8I32, None)
            acc = [[cgutils.alloca_once_value(builder, zero) for _ in range(accs)] for _ in range(rows)]
            base = ir.Constant(_V32I8, [(37 * j + 11) % 256 for j in range(LANES * QUAD)])
            low_mask = ir.Constant(_V32I8, [0x0F] * (LANES * QUAD))
            four = ir.Constant(_V32I8, [4] * (LANES * QUAD))
            with cgutils.for_range(builder, n) as loop:
                step = builder.trunc(loop.index, _I8)
                # the activations of this step: one of two copies, so their loads stay in the loop
                x_step = builder.mul(builder.and_(loop.index, ir.Constant(_I64, 1)),
                                     ir.Constant(_I64, rows * LOADS * 2))
                first = 0
                for u in range(LOADS):
                    splat = qdot._splat(builder, builder.add(step, ir.Constant(_I8, 17 * u)), _V32I8)
                    raw = builder.add(base, splat)  # the codes this step: nothing to hoist out of the loop
                    magnitudes = qdot.magnitude(builder, raw) if sign_trick else None
                    parts = [builder.and_(raw, low_mask), builder.lshr(raw, four)] if nibbles else \
                        [raw if sign_trick else builder.xor(raw, ir.Constant(_V32I8, [0x80] * 32))]
                    for p, codes in enumerate(parts):
                        for i in range(rows):
                            a = acc[i][first % accs]
                            at = builder.add(x_step, ir.Constant(_I64, (i * LOADS + u) * 2 + p))
                            x4 = builder.load(builder.gep(x_data, [at]))
                            builder.store(qdot._dpbusd(builder, builder.load(a), codes, x4, nibbles, magnitudes), a)
                        first += 1
            total = ir.Constant(_V8I32, None)
            for row_acc in acc:
                for a in row_acc:
                    v = builder.load(a)
                    total = builder.add(total, qdot.widen_pairs(builder, v) if pairs else v)
            out = builder.extract_element(total, ir.Constant(_I32, 0))
            for j in range(1, LANES):
                out = builder.add(out, builder.extract_element(total, ir.Constant(_I32, j)))
            return builder.sext(out, _I64)

        return sig, codegen

    @njit
    def run(steps, xs):
        return peak(steps, xs)

    macs_per_step = LOADS * rows * LANES * QUAD * (2 if nibbles else 1)
    return run, macs_per_step


def _best_rate(fn, macs: int, repeats: int) -> float:
    """G multiply-adds/s of the fastest of `repeats` calls of fn (thread CPU time)."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.thread_time()
        fn()
        best = min(best, time.thread_time() - t0)
    return macs / best / 1e9


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4], choices=[1, 2, 3, 4, 8],
                   help="rows of x a block of the peak loop (the kernel's tile_dot_R)")
    p.add_argument("--kernel-rows", type=int, nargs="+", default=[1, 16],
                   help="rows of x the kernel is timed at, paired in order with --rows")
    p.add_argument("--shape", type=int, nargs=2, default=[1536, 512])
    p.add_argument("--steps", type=int, default=1_000_000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    if len(args.kernel_rows) != len(args.rows):
        p.error("--kernel-rows pairs with --rows: give as many")
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from gguf_files import blocks
    from kvlab.model.quantized import QuantizedMatrix

    numba.set_num_threads(1)
    path = "vnni" if qdot.VNNI else "avx2 (vpmaddubsw)" if qdot.MADD else "generic"
    print(f"G multiply-adds/s, one thread (path: {path}); best of {args.repeats} a round, {args.rounds} rounds; "
          f"kernel: {args.shape[0]}x{args.shape[1]} matrix")
    rng = np.random.default_rng(0)
    n, k = args.shape
    for type_name, nibbles in (("Q8_0", False), ("Q4_0", True)):
        matrix = QuantizedMatrix.from_blocks(type_name, blocks(type_name, n, k, rng, "normal"), (n, k))
        for rows, m in zip(args.rows, args.kernel_rows):
            run, macs = _make_peak(rows, nibbles)
            xs = rng.integers(-127, 128, size=(2 * rows * LOADS * 2, 4), dtype=np.int8)
            xs = xs.view(np.int32).ravel()  # each row's four int8 activations a load, as one int32
            x = rng.standard_normal((m, k)).astype(np.float32)
            run(10, xs), matrix.matmul_t(x, True, "q8")  # compile, and the dot layout made
            calls = max(20, 400 // m)

            def kernel() -> None:
                for _ in range(calls):
                    matrix.matmul_t(x, True, "q8")

            peaks, kernels = [], []
            for _ in range(args.rounds):
                peaks.append(_best_rate(lambda: run(args.steps, xs), macs * args.steps, args.repeats))
                kernels.append(_best_rate(kernel, calls * m * n * k, args.repeats))
            share = statistics.median(kr / pk for kr, pk in zip(kernels, peaks))
            print(f"{type_name} ({'nibbles' if nibbles else '8-bit codes'}): peak, {rows}-row blocks "
                  f"{max(peaks):6.1f}   kernel, M={m:<3d} {max(kernels):6.1f}   kernel / peak {share:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
