"""Decode attention's two tile products as LLVM vector code: eight keys' scores in one register.

A decode step's attention is, per KV head, G query rows against every cached key (scores) and the
softmax weights against every value row (the weighted sum). Written as numba loops over the head dim,
LLVM vectorises each 64-long dot product on its own and ends it with a horizontal sum of its eight lanes
plus the loop's set-up: about 70 instructions a key row for G = 3, ~35 ns a key row with the rows in
cache (one thread, SmolLM2-135M's shape), so the kernel could not keep up with DRAM's stream.

Here the loops are explicit vectors, as qsimd.py does for the quantized products:

- `scores`: per query head g its row q_g sits in d/8 registers; eight keys at a time, each key's d/8
  FMAs (the key row as memory operands) go into one accumulator of its own (eight chains in flight),
  and the eight accumulators are reduced together by a transpose-and-add (three rounds of two shuffles
  and an add), so one vector store writes eight scores. About 10 instructions per key and head.
- `values`: per head g its output row acc_g sits in d/8 registers for the whole tile; each key adds
  p_gt * v_t with one broadcast and d/8 FMAs. The FMAs bound it (d/8 per key and head).

The tile rows are the compute dtype, float32 (the caller widens or dequantizes other stores into a tile
first, attention.py). Rows past n in the last eight-key block are read as row n-1 again (never past the
tile), and their scores are written past the tile's columns: `scores` [G, W] needs W >= col + the tile
rounded up to 8 (the next tile's scores overwrite them). The sums are the reference's up to summation order
(fastmath's reassoc, as the numba loops).

Filling that tile is vector code too: `widen_run` (float16/bfloat16 bits, exact), `dequantize_int8` and
`dequantize_int4` (codes times their group's float16 scale plus its zero, as stored; int4's two nibbles
a byte are interleaved back in registers). Each falls back to a numba loop for float64 or shapes it does
not cover. tests/test_attention_simd.py holds each to NumPy and checks the assembly; tests/test_kernels*.py
hold the whole kernel to its NumPy twin.
"""

from __future__ import annotations

from llvmlite import ir
import numpy as np
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from kvlab.kernels.bits import widen
from kvlab.kernels.qsimd import LANES, _broadcast, _fma, _load

_F32 = ir.FloatType()
_I32 = ir.IntType(32)
_V8F = ir.VectorType(_F32, LANES)
CHUNKS = (4, 8, 16)  # head dims 32, 64, 128 (d / 8 registers a row): the unrolled specialisations
_PAIRS = ([0, 8, 2, 10, 4, 12, 6, 14], [1, 9, 3, 11, 5, 13, 7, 15])      # round 1: key pairs
_QUADS = ([0, 1, 8, 9, 4, 5, 12, 13], [2, 3, 10, 11, 6, 7, 14, 15])      # round 2: key quads, per half
_HALVES = ([0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15])     # round 3: the two halves


def _fold(builder: ir.IRBuilder, x: ir.Value, y: ir.Value, masks: tuple[list[int], list[int]]) -> ir.Value:
    lo = builder.shuffle_vector(x, y, ir.Constant(ir.VectorType(_I32, LANES), masks[0]))
    hi = builder.shuffle_vector(x, y, ir.Constant(ir.VectorType(_I32, LANES), masks[1]))
    return builder.fadd(lo, hi)


def _transpose_sum(builder: ir.IRBuilder, acc: list[ir.Value]) -> ir.Value:
    """Eight vectors in, one out: lane j is the sum of acc[j]'s lanes."""
    pairs = [_fold(builder, acc[2 * p], acc[2 * p + 1], _PAIRS) for p in range(4)]
    quads = [_fold(builder, pairs[2 * q], pairs[2 * q + 1], _QUADS) for q in range(2)]
    return _fold(builder, quads[0], quads[1], _HALVES)


def _int(builder: ir.IRBuilder, value: ir.Value, intp: ir.Type) -> ir.Value:
    return builder.sext(value, intp) if value.type != intp else value


def _arrays(context, builder, signature, args, which):
    return [cgutils.create_struct_proxy(signature.args[i])(context, builder, value=args[i]) for i in which]


def _row_base(builder, rows, b, h, r0, intp):
    """Element offset of row (b, h, r0) of a C-contiguous [B, H, R, d] array, and d."""
    _, heads, length, width = cgutils.unpack_tuple(builder, rows.shape)
    return builder.mul(builder.add(builder.mul(builder.add(builder.mul(b, heads), h), length), r0), width), width


def _make_scores(chunks: int):
    @intrinsic
    def scores(typingctx, q, first_head, out, col, rows, b, h, r0, n):
        """out[g, col + t] = q[first_head + g] . rows[b, h, r0 + t] for g < out.shape[0], t < n (then up to
        the next multiple of 8: row n-1's score again)."""
        if not all(a.dtype == types.float32 for a in (q, out, rows)):
            return None

        def codegen(context, builder, signature, args):
            intp = context.get_value_type(types.intp)
            qa, oa, ra = _arrays(context, builder, signature, args, (0, 2, 4))
            first, colv, bv, hv, r0v, nv = (_int(builder, args[i], intp) for i in (1, 3, 5, 6, 7, 8))
            heads, width = cgutils.unpack_tuple(builder, oa.shape)
            d = cgutils.unpack_tuple(builder, qa.shape)[1]
            base, _ = _row_base(builder, ra, bv, hv, r0v, intp)
            rows0 = builder.gep(ra.data, [base])
            last = builder.sub(nv, ir.Constant(intp, 1))
            blocks = builder.udiv(builder.add(nv, ir.Constant(intp, LANES - 1)), ir.Constant(intp, LANES))
            with cgutils.for_range(builder, heads) as g_loop:
                q_row = builder.gep(qa.data, [builder.mul(builder.add(first, g_loop.index), d)])
                qv = [_load(builder, q_row, ir.Constant(intp, LANES * c), _V8F) for c in range(chunks)]
                out_row = builder.gep(oa.data, [builder.add(builder.mul(g_loop.index, width), colv)])
                with cgutils.for_range(builder, blocks) as k_loop:
                    t0 = builder.mul(k_loop.index, ir.Constant(intp, LANES))
                    acc = []
                    for j in range(LANES):
                        t = builder.add(t0, ir.Constant(intp, j))
                        t = builder.select(builder.icmp_signed(">", t, last), last, t)
                        row = builder.gep(rows0, [builder.mul(t, d)])
                        a = builder.fmul(qv[0], _load(builder, row, ir.Constant(intp, 0), _V8F))
                        for c in range(1, chunks):
                            a = _fma(builder, qv[c], _load(builder, row, ir.Constant(intp, LANES * c), _V8F), a)
                        acc.append(a)
                    total = _transpose_sum(builder, acc)
                    builder.store(total, builder.bitcast(builder.gep(out_row, [t0]), _V8F.as_pointer()), align=1)
            return context.get_dummy_value()

        return types.void(q, first_head, out, col, rows, b, h, r0, n), codegen

    return scores


def _make_values(chunks: int):
    @intrinsic
    def values(typingctx, weights, col, rows, b, h, r0, n, acc):
        """acc[g] += sum_{t < n} weights[g, col + t] rows[b, h, r0 + t] for g < acc.shape[0], key by key in
        order (so splitting the keys into tiles anywhere gives the same bits)."""
        if not all(a.dtype == types.float32 for a in (weights, rows, acc)):
            return None

        def codegen(context, builder, signature, args):
            intp = context.get_value_type(types.intp)
            wa, ra, aa = _arrays(context, builder, signature, args, (0, 2, 7))
            colv, bv, hv, r0v, nv = (_int(builder, args[i], intp) for i in (1, 3, 4, 5, 6))
            heads, d = cgutils.unpack_tuple(builder, aa.shape)
            width = cgutils.unpack_tuple(builder, wa.shape)[1]
            base, _ = _row_base(builder, ra, bv, hv, r0v, intp)
            rows0 = builder.gep(ra.data, [base])
            with cgutils.for_range(builder, heads) as g_loop:
                acc_row = builder.gep(aa.data, [builder.mul(g_loop.index, d)])
                w_row = builder.gep(wa.data, [builder.add(builder.mul(g_loop.index, width), colv)])
                slots = [cgutils.alloca_once_value(builder, _load(builder, acc_row, ir.Constant(intp, LANES * c),
                                                                  _V8F)) for c in range(chunks)]
                with cgutils.for_range(builder, nv) as t_loop:
                    p = _broadcast(builder, builder.load(builder.gep(w_row, [t_loop.index])))
                    row = builder.gep(rows0, [builder.mul(t_loop.index, d)])
                    for c, slot in enumerate(slots):
                        v = _load(builder, row, ir.Constant(intp, LANES * c), _V8F)
                        builder.store(_fma(builder, p, v, builder.load(slot)), slot)
                for c, slot in enumerate(slots):
                    ptr = builder.bitcast(builder.gep(acc_row, [ir.Constant(intp, LANES * c)]), _V8F.as_pointer())
                    builder.store(builder.load(slot), ptr, align=1)
            return context.get_dummy_value()

        return types.void(weights, col, rows, b, h, r0, n, acc), codegen

    return values


_SCORES = {c: _make_scores(c) for c in CHUNKS}
_VALUES = {c: _make_values(c) for c in CHUNKS}
_s4, _s8, _s16 = (_SCORES[c] for c in CHUNKS)
_v4, _v8, _v16 = (_VALUES[c] for c in CHUNKS)


def simd_scores(q, first_head, out, col, rows, b, h, r0, n, fallback, zero):  # pragma: no cover - overloaded
    """The vector scores for float32 rows of head dim 32/64/128, into out's columns col..; otherwise
    `fallback` (the numba loops, same arguments and `zero`)."""
    raise NotImplementedError


def simd_values(weights, col, rows, b, h, r0, n, acc, fallback):  # pragma: no cover - overloaded
    """The vector weighted sum (weights from column col on) for float32 rows of head dim 32/64/128;
    otherwise `fallback`."""
    raise NotImplementedError


def _is_f32(*arrays) -> bool:
    return all(isinstance(a, types.Array) and a.dtype == types.float32 and a.layout == "C" for a in arrays)


@overload(simd_scores, inline="always")
def _simd_scores(q, first_head, out, col, rows, b, h, r0, n, fallback, zero):
    if not _is_f32(q, out, rows):
        return lambda q, first_head, out, col, rows, b, h, r0, n, fallback, zero: fallback(
            q, first_head, out, col, rows, b, h, r0, n, zero)

    def vector(q, first_head, out, col, rows, b, h, r0, n, fallback, zero):
        d = rows.shape[3]
        if d == 64:
            _s8(q, first_head, out, col, rows, b, h, r0, n)
        elif d == 128:
            _s16(q, first_head, out, col, rows, b, h, r0, n)
        elif d == 32:
            _s4(q, first_head, out, col, rows, b, h, r0, n)
        else:
            fallback(q, first_head, out, col, rows, b, h, r0, n, zero)
    return vector


@overload(simd_values, inline="always")
def _simd_values(weights, col, rows, b, h, r0, n, acc, fallback):
    if not _is_f32(weights, rows, acc):
        return lambda weights, col, rows, b, h, r0, n, acc, fallback: fallback(weights, col, rows, b, h, r0, n, acc)

    def vector(weights, col, rows, b, h, r0, n, acc, fallback):
        d = rows.shape[3]
        if d == 64:
            _v8(weights, col, rows, b, h, r0, n, acc)
        elif d == 128:
            _v16(weights, col, rows, b, h, r0, n, acc)
        elif d == 32:
            _v4(weights, col, rows, b, h, r0, n, acc)
        else:
            fallback(weights, col, rows, b, h, r0, n, acc)
    return vector


_F16_SCALE = 2.0 ** 112  # float16 bits moved into float32's layout are off by 2^(127 - 15), as bits.widen


def _widen_f16(builder: ir.IRBuilder, bits: ir.Value) -> ir.Value:
    """float32 of float16 bits (an i16), as bits.widen: exponent and mantissa moved up 13, sign up 16."""
    wide = builder.zext(bits, _I32)
    moved = builder.or_(builder.shl(builder.and_(wide, ir.Constant(_I32, 0x7FFF)), ir.Constant(_I32, 13)),
                        builder.shl(builder.and_(wide, ir.Constant(_I32, 0x8000)), ir.Constant(_I32, 16)))
    return builder.fmul(builder.bitcast(moved, _F32), ir.Constant(_F32, _F16_SCALE))


def _make_dequantize(nibbles: bool):
    @intrinsic
    def dequantize(typingctx, codes, scale_bits, zero_bits, group, out):
        """out[i] = zero_j + code_i * scale_j, j = i // group, over a flat 1-D run of int-cache rows: codes
        uint8 (one a byte, or for int4 two: value 2i in byte i's low nibble, 2i + 1 in its high), one
        float16 scale and zero (as int16 bits) per `group` values (a multiple of 8, of 16 for nibbles), as
        many groups as scales. Eight codes are widened, converted and scaled per instruction group."""
        if codes.dtype != types.uint8 or scale_bits.dtype != types.int16 or out.dtype != types.float32:
            return None

        def codegen(context, builder, signature, args):
            intp = context.get_value_type(types.intp)
            ca, sa, za, oa = (cgutils.create_struct_proxy(signature.args[i])(context, builder, value=args[i])
                              for i in (0, 1, 2, 4))
            group_v = _int(builder, args[3], intp)
            groups = cgutils.unpack_tuple(builder, sa.shape)[0]
            per_load = 2 * LANES if nibbles else LANES  # values that one 8-byte load holds
            chunks = builder.udiv(group_v, ir.Constant(intp, per_load))
            v8i8, v8i32 = ir.VectorType(ir.IntType(8), LANES), ir.VectorType(_I32, LANES)
            low_mask, shift = ir.Constant(v8i32, [15] * LANES), ir.Constant(v8i32, [4] * LANES)
            mask = ir.VectorType(_I32, LANES)

            def store(vector, at):
                builder.store(vector, builder.bitcast(builder.gep(oa.data, [at]), _V8F.as_pointer()), align=1)

            with cgutils.for_range(builder, groups) as g_loop:
                j = g_loop.index
                s = _broadcast(builder, _widen_f16(builder, builder.load(builder.gep(sa.data, [j]))))
                z = _broadcast(builder, _widen_f16(builder, builder.load(builder.gep(za.data, [j]))))
                base = builder.mul(j, group_v)
                with cgutils.for_range(builder, chunks) as c_loop:
                    at = builder.add(base, builder.mul(c_loop.index, ir.Constant(intp, per_load)))
                    byte = builder.udiv(at, ir.Constant(intp, 2)) if nibbles else at
                    wide = builder.zext(_load(builder, ca.data, byte, v8i8), v8i32)
                    if nibbles:  # values 2i and 2i + 1 from byte i's low and high nibble, interleaved back
                        low = _fma(builder, builder.uitofp(builder.and_(wide, low_mask), _V8F), s, z)
                        high = _fma(builder, builder.uitofp(builder.lshr(wide, shift), _V8F), s, z)
                        store(builder.shuffle_vector(low, high, ir.Constant(mask, [0, 8, 1, 9, 2, 10, 3, 11])), at)
                        store(builder.shuffle_vector(low, high, ir.Constant(mask, [4, 12, 5, 13, 6, 14, 7, 15])),
                              builder.add(at, ir.Constant(intp, LANES)))
                    else:
                        store(_fma(builder, builder.uitofp(wide, _V8F), s, z), at)
            return context.get_dummy_value()

        return types.void(codes, scale_bits, zero_bits, group, out), codegen

    return dequantize


_dequantize_int8_f32 = _make_dequantize(nibbles=False)
_dequantize_int4_f32 = _make_dequantize(nibbles=True)


def dequantize_int8(codes, scale_bits, zero_bits, group, out, zero):  # pragma: no cover - overloaded
    """out[i] = zero_j + codes[i] * scale_j, j = i // group (flat 1-D runs, as `_dequantize_int8_f32`):
    the vector code for float32 out and groups of a multiple of 8, else a loop (float64 references)."""
    raise NotImplementedError


@njit(inline="always")
def _dequantize_int8_loop(codes, scale_bits, zero_bits, group, out, zero):
    for j in range(scale_bits.shape[0]):
        s, z, base = zero + widen(scale_bits[j]), zero + widen(zero_bits[j]), j * group
        for i in range(group):
            out[base + i] = z + codes[base + i] * s


def _register_dequantize(public, vector, loop, multiple: int) -> None:
    """Overload `public` (codes, scale_bits, zero_bits, group, out, zero): the vector code for float32 out
    and groups of a multiple of `multiple`, else the numba loop."""
    @overload(public, inline="always")
    def _choose(codes, scale_bits, zero_bits, group, out, zero):
        if not _is_f32(out):
            return lambda codes, scale_bits, zero_bits, group, out, zero: loop(
                codes, scale_bits, zero_bits, group, out, zero)

        def chosen(codes, scale_bits, zero_bits, group, out, zero):
            if group % multiple == 0:
                vector(codes, scale_bits, zero_bits, group, out)
            else:
                loop(codes, scale_bits, zero_bits, group, out, zero)
        return chosen


_register_dequantize(dequantize_int8, _dequantize_int8_f32, _dequantize_int8_loop, LANES)


@intrinsic
def _widen_half_f32(typingctx, src, out):
    """out[i] = float32 of src[i] for a flat run of half-precision bits (uint16: bfloat16, shifted up 16;
    int16: float16, moved and scaled as bits.widen), eight at a time; len(out) a multiple of 8."""
    if src.dtype not in (types.uint16, types.int16) or out.dtype != types.float32:
        return None
    brain = src.dtype == types.uint16

    def codegen(context, builder, signature, args):
        intp = context.get_value_type(types.intp)
        sa, oa = (cgutils.create_struct_proxy(signature.args[i])(context, builder, value=args[i]) for i in (0, 1))
        count = builder.udiv(cgutils.unpack_tuple(builder, oa.shape)[0], ir.Constant(intp, LANES))
        v8i16, v8i32 = ir.VectorType(ir.IntType(16), LANES), ir.VectorType(_I32, LANES)

        def splat(value: int) -> ir.Constant:
            return ir.Constant(v8i32, [value] * LANES)

        with cgutils.for_range(builder, count) as loop:
            at = builder.mul(loop.index, ir.Constant(intp, LANES))
            wide = builder.zext(_load(builder, sa.data, at, v8i16), v8i32)
            if brain:
                x = builder.bitcast(builder.shl(wide, splat(16)), _V8F)
            else:
                moved = builder.or_(builder.shl(builder.and_(wide, splat(0x7FFF)), splat(13)),
                                    builder.shl(builder.and_(wide, splat(0x8000)), splat(16)))
                x = builder.fmul(builder.bitcast(moved, _V8F), ir.Constant(_V8F, [_F16_SCALE] * LANES))
            builder.store(x, builder.bitcast(builder.gep(oa.data, [at]), _V8F.as_pointer()), align=1)
        return context.get_dummy_value()

    return types.void(src, out), codegen


def widen_run(src, out, zero):  # pragma: no cover - overloaded
    """out[i] = zero + widen(src[i]) over a flat run (bits.widen): vector code for half-precision bits
    into float32 when the run is a multiple of 8 long, else the loop."""
    raise NotImplementedError


@njit(inline="always")
def _widen_loop(src, out, zero):
    for i in range(out.shape[0]):
        out[i] = zero + widen(src[i])


@overload(widen_run, inline="always")
def _widen_run(src, out, zero):
    if not (_is_f32(out) and isinstance(src, types.Array) and src.dtype in (types.uint16, types.int16)):
        return lambda src, out, zero: _widen_loop(src, out, zero)

    def vector(src, out, zero):
        if out.shape[0] % LANES == 0:
            _widen_half_f32(src, out)
        else:
            _widen_loop(src, out, zero)
    return vector


def dequantize_int4(codes, scale_bits, zero_bits, group, out, zero):  # pragma: no cover - overloaded
    """As dequantize_int8 for int4 codes, two a byte (low nibble first): the vector code for float32 out
    and groups of a multiple of 16, else a loop."""
    raise NotImplementedError


@njit(inline="always")
def _dequantize_int4_loop(codes, scale_bits, zero_bits, group, out, zero):
    for j in range(scale_bits.shape[0]):
        s, z, base = zero + widen(scale_bits[j]), zero + widen(zero_bits[j]), j * group
        half = base // 2
        for i in range(group // 2):
            c = codes[half + i]
            out[base + 2 * i] = z + np.float32(c & 15) * s  # float32: no int64 -> float64
            out[base + 2 * i + 1] = z + np.float32(c >> 4) * s


_register_dequantize(dequantize_int4, _dequantize_int4_f32, _dequantize_int4_loop, 2 * LANES)
