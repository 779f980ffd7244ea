"""Float products whose every row has one summation order, written as LLVM vector code.

`x @ w.T` over float32, float16 or bfloat16 weights sums x[m, k] * w[n, k] over k. With fastmath's
`reassoc`, LLVM picks the order: how many vector accumulators a loop gets (its interleave) depends on the
registers the loop body needs, so a block of four rows of x and a single row were summed in different
orders, and a row's bits depended on how many rows ran beside it. On AVX-512 the choices happened to agree;
on an AVX2 CPU (Zen 3) a verification row of speculative decoding came out 1e-7 apart from the one-token
step it must equal (tests/test_speculative.py). Here the order is written down, the same for every block
of rows: each row's dot product keeps CHAINS accumulators of LANES float32 lanes; chunk j of eight columns
(k = 8j..8j+7) goes into accumulator j % CHAINS, one rounding per product (llvm.fma); a last partial chunk
is zero-filled and goes where chunk j would; then the accumulators are added in order, and the eight lanes
by a fixed tree ((0+4)+(2+6))+((1+5)+(3+7)). So `row_dot_1`, `row_dot_2` and `row_dot_4` give a row the same
bits, and `kvlab.kernels.gemv.products` gives every row of a decode step, a batch or a verification the bits
it would get alone (tests/test_fdot.py).

`row_dot_R(x, m0, w, n, out)`: out[m0 + i, n] = x[m0 + i] . w[n] for i < R, x float32 [M, K] and out
float32 [M, N] with unit stride along their rows, w [N, K] C-contiguous float32, or float16 / bfloat16 bits
(int16 / uint16, kvlab.kernels.bits), widened in registers (vcvtph2ps; a 16-bit shift).
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from kvlab.kernels.qsimd import LANES, _fma

CHAINS = 2  # accumulators per row: two FMA chains in flight per row (four for R = 2, eight for R = 4)
_F32 = ir.FloatType()
_I16 = ir.IntType(16)
_I32 = ir.IntType(32)
_V8F = ir.VectorType(_F32, LANES)
_V8I16 = ir.VectorType(_I16, LANES)
_V8I32 = ir.VectorType(_I32, LANES)
_V8H = ir.VectorType(ir.HalfType(), LANES)
_WEIGHTS = {types.float32: "f32", types.int16: "f16", types.uint16: "bf16"}


def _widen_vector(builder: ir.IRBuilder, kind: str, ptr: ir.Value) -> ir.Value:
    """Eight weights at `ptr` as float32 lanes."""
    if kind == "f32":
        return builder.load(builder.bitcast(ptr, _V8F.as_pointer()), align=1)
    raw = builder.load(builder.bitcast(ptr, _V8I16.as_pointer()), align=1)
    if kind == "f16":
        return builder.fpext(builder.bitcast(raw, _V8H), _V8F)
    return builder.bitcast(builder.shl(builder.zext(raw, _V8I32), ir.Constant(_V8I32, [16] * LANES)), _V8F)


def _widen_scalar(builder: ir.IRBuilder, kind: str, ptr: ir.Value) -> ir.Value:
    """The weight at `ptr` as a float32 (the same value a lane of `_widen_vector` gets)."""
    if kind == "f32":
        return builder.load(ptr)
    raw = builder.load(ptr)
    if kind == "f16":
        return builder.fpext(builder.bitcast(raw, ir.HalfType()), _F32)
    return builder.bitcast(builder.shl(builder.zext(raw, _I32), ir.Constant(_I32, 16)), _F32)


def _lanes_sum(builder: ir.IRBuilder, v: ir.Value) -> ir.Value:
    """The eight lanes added as ((0+4)+(2+6))+((1+5)+(3+7)), in IEEE order (no fast-math flags)."""
    def half(vec: ir.Value, lanes: list[int]) -> ir.Value:
        return builder.shuffle_vector(vec, vec, ir.Constant(ir.VectorType(_I32, len(lanes)), lanes))
    four = builder.fadd(half(v, [0, 1, 2, 3]), half(v, [4, 5, 6, 7]))
    two = builder.fadd(half(four, [0, 1]), half(four, [2, 3]))
    return builder.fadd(builder.extract_element(two, ir.Constant(_I32, 0)),
                        builder.extract_element(two, ir.Constant(_I32, 1)))


def _make_row_dot(rows: int):
    @intrinsic
    def row_dot(typingctx, x, m0, w, n, out):
        kind = _WEIGHTS.get(getattr(w, "dtype", None))
        if kind is None or x.dtype != types.float32 or out.dtype != types.float32:
            return None
        sig = types.void(x, m0, w, n, out)

        def codegen(context, builder, signature, args):
            xa, m0v, wa, nv, outa = args
            xs, ws, outs = (cgutils.create_struct_proxy(ty)(context, builder, value=v)
                            for ty, v in zip((signature.args[0], signature.args[2], signature.args[4]),
                                             (xa, wa, outa)))
            intp = context.get_value_type(types.intp)

            def const(value: int) -> ir.Constant:
                return ir.Constant(intp, value)

            def index(value: ir.Value) -> ir.Value:
                return builder.sext(value, intp) if value.type != intp else value

            depth = cgutils.unpack_tuple(builder, xs.shape)[1]
            x_stride = cgutils.unpack_tuple(builder, xs.strides)[0]
            out_stride = cgutils.unpack_tuple(builder, outs.strides)[0]
            m0_v, n_v = index(m0v), index(nv)
            w_row = builder.gep(ws.data, [builder.mul(n_v, cgutils.unpack_tuple(builder, ws.shape)[1])])

            def row_pointer(data: ir.Value, stride: ir.Value, i: int) -> ir.Value:
                raw = builder.bitcast(data, ir.IntType(8).as_pointer())
                at = builder.gep(raw, [builder.mul(builder.add(m0_v, const(i)), stride)])
                return builder.bitcast(at, _F32.as_pointer())

            x_rows = [row_pointer(xs.data, x_stride, i) for i in range(rows)]
            zero = ir.Constant(_V8F, [0.0] * LANES)
            acc = [[cgutils.alloca_once_value(builder, zero) for _ in range(CHAINS)] for _ in range(rows)]

            def chunk(k: ir.Value, chain: int, wv: ir.Value | None = None, xv: list | None = None) -> None:
                """acc[.][chain] += x[., k:k+8] * w[n, k:k+8], rounded once per product."""
                wv = _widen_vector(builder, kind, builder.gep(w_row, [k])) if wv is None else wv
                for i in range(rows):
                    xi = builder.load(builder.bitcast(builder.gep(x_rows[i], [k]), _V8F.as_pointer()), align=1) \
                        if xv is None else xv[i]
                    builder.store(_fma(builder, xi, wv, builder.load(acc[i][chain])), acc[i][chain])

            chunks = builder.udiv(depth, const(LANES))
            with cgutils.for_range(builder, builder.udiv(chunks, const(CHAINS))) as loop:
                for c in range(CHAINS):
                    chunk(builder.mul(builder.add(builder.mul(loop.index, const(CHAINS)), const(c)), const(LANES)), c)
            done = builder.mul(builder.udiv(chunks, const(CHAINS)), const(CHAINS))
            for c in range(CHAINS - 1):  # the full chunks left over, each into its own chain
                j = builder.add(done, const(c))
                with builder.if_then(builder.icmp_unsigned("<", j, chunks)):
                    chunk(builder.mul(j, const(LANES)), c)
            left = builder.urem(depth, const(LANES))
            with builder.if_then(builder.icmp_unsigned(">", left, const(0)), likely=False):
                # the partial chunk, zero-filled (0 * 0 adds nothing), into chunk index `chunks`' chain
                k0 = builder.mul(chunks, const(LANES))
                w_tail = cgutils.alloca_once_value(builder, zero)
                x_tail = [cgutils.alloca_once_value(builder, zero) for _ in range(rows)]
                with cgutils.for_range(builder, left) as e:
                    k = builder.add(k0, e.index)
                    slot = builder.gep(builder.bitcast(w_tail, _F32.as_pointer()), [e.index])
                    builder.store(_widen_scalar(builder, kind, builder.gep(w_row, [k])), slot)
                    for i in range(rows):
                        builder.store(builder.load(builder.gep(x_rows[i], [k])),
                                      builder.gep(builder.bitcast(x_tail[i], _F32.as_pointer()), [e.index]))
                wv = builder.load(w_tail)
                xv = [builder.load(t) for t in x_tail]
                chain_of = builder.urem(chunks, const(CHAINS))
                for c in range(CHAINS):
                    with builder.if_then(builder.icmp_unsigned("==", chain_of, const(c))):
                        chunk(k0, c, wv, xv)
            for i in range(rows):
                total = builder.load(acc[i][0])
                for a in acc[i][1:]:
                    total = builder.fadd(total, builder.load(a))
                dot = _lanes_sum(builder, total)
                builder.store(dot, builder.gep(row_pointer(outs.data, out_stride, i), [n_v]))
            return context.get_dummy_value()

        return sig, codegen

    return row_dot


row_dot_1 = _make_row_dot(1)
row_dot_2 = _make_row_dot(2)
row_dot_4 = _make_row_dot(4)
