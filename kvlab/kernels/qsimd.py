"""The inner loop of the quantized products, written as LLVM vector code: eight output rows in one register.

The kernels' layout (kvlab/model/qtiles.py) interleaves a tile of LANES = 8 output rows, so that per
weight column k the eight rows' codes are eight consecutive bytes. One step of the inner loop is then
one 8-byte load, widened to eight int32 (vpmovsxbd for int8 codes; vpmovzxbd + and/shift for nibbles,
two columns per byte), converted to float32 (vcvtdq2ps) and multiplied into eight accumulators by the
broadcast x[k] (vfmadd231ps): no horizontal sum per group, one per-group `acc * scale (+ offset * sum_g x)`
on the eight lanes at once. That is the dequantized product up to summation order (codes are exact small
integers, scales and offsets the file's, every product rounded once in an FMA).

Why LLVM IR and not numba source: written as eight scalar accumulators in numba, LLVM vectorises the
loop over k instead (a horizontal sum per group and per row, as before) or not at all; only explicit
vectors give the lanes-are-rows loop (`tile_product`'s assembly holds vpmovsxbd/vcvtdq2ps/vfmadd231ps on
ymm registers, tests/test_quantized_kernels.py checks it).

`tile_product_R(x, m0, xsum, codes, scales, offsets, base_scales, base_offsets, group, t, out)` (R = 1..4
rows of x, each a compile-time constant so the R accumulators stay in registers) writes out[m0:m0+R,
8t:8t+8] = the R rows x[m0:m0+R] times tile t's eight weight rows. Codes int8 [T, G*group*8], nibbles
uint8 [T, G*group*4] (byte (g, j, r): row r's weight j of group g in its low nibble, weight j + 16 in its
high), or 5-bit codes uint8 [T, G, 5, 32] (groups of 32: model/qtiles.to_dot_codes5, the integer kernels'
own layout, so the exact mode keeps 5 bits a weight as the file does; a load of 32 bytes is four columns of
the eight rows, read as eight int32 lanes, one row each, a shift and a mask a column), or 6-bit codes int8
[T, G, 3, 32] (Q6_K's, groups of 16: qtiles.to_dot_codes6, code + 32, taken off here); scales and offsets
float32 [T, G*8], or a K type's factored int8 [T, G*8] with float32 bases
[T, SB*8] a super-block and row (model/qtiles.factor_scales: base * float(int) is the float32 scale, bit
for bit, so the products are the same); an offsets array with no rows means none (then xsum is not read);
xsum [M, G] float32 the group sums of x.
x, xsum and out C-contiguous float32.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from kvlab.kernels.layout import BIT_PLANE, CRUMB_PLANE, LANES, QUAD, SMALL_BIAS

UNROLL = {1: 4, 2: 2, 3: 2, 4: 2}
_F32 = ir.FloatType()
_I32 = ir.IntType(32)
_V8F = ir.VectorType(_F32, LANES)
_V8I8 = ir.VectorType(ir.IntType(8), LANES)
_V8I32 = ir.VectorType(_I32, LANES)
_V32I8 = ir.VectorType(ir.IntType(8), LANES * QUAD)


def _fma(builder: ir.IRBuilder, a: ir.Value, b: ir.Value, c: ir.Value) -> ir.Value:
    """a * b + c on float32 lanes, rounded once: llvm.fma.v8f32 (vfmadd on AVX2) or, for a tile pair's 16
    lanes, llvm.fma.v16f32 (one zmm vfmadd)."""
    vector = a.type
    name = f"llvm.fma.v{vector.count}f32"
    fn = builder.module.globals.get(name) or ir.Function(builder.module, ir.FunctionType(vector, [vector] * 3),
                                                         name=name)
    return builder.call(fn, [a, b, c])


def _broadcast(builder: ir.IRBuilder, value: ir.Value) -> ir.Value:
    one = builder.insert_element(ir.Constant(_V8F, ir.Undefined), value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(one, ir.Constant(_V8F, ir.Undefined), ir.Constant(_V8I32, [0] * LANES))


def _load(builder: ir.IRBuilder, base: ir.Value, index: ir.Value, vector: ir.Type) -> ir.Value:
    """The vector at element `index` of `base` (unaligned)."""
    ptr = builder.bitcast(builder.gep(base, [index]), vector.as_pointer())
    return builder.load(ptr, align=1)


def fifth_bits(builder: ir.IRBuilder, at: ir.Value) -> tuple[ir.Value, ir.Value]:
    """A load's fifth bits (the 8 bytes at `at` of a plane of bits, qtiles.to_dot_codes5: byte r = row r's bits,
    bit c for its low nibbles' column c, 4 + c for its high nibbles') as two 32-byte vectors of 0 or 16 beside
    the load's low and high nibbles (byte 4r + c): each row's byte copied to its four lanes (one shuffle),
    then each lane's bit tested. Generic IR: a byte shuffle, and, compare and select where AVX2 has them."""
    row_bytes = builder.load(builder.bitcast(at, _V8I8.as_pointer()), align=1)
    spread = builder.shuffle_vector(row_bytes, ir.Constant(_V8I8, ir.Undefined),
                                    ir.Constant(ir.VectorType(_I32, LANES * QUAD), [j // QUAD for j in range(32)]))
    zero, sixteen = ir.Constant(_V32I8, [0] * 32), ir.Constant(_V32I8, [16] * 32)
    out = []
    for shift in (0, 4):
        masks = ir.Constant(_V32I8, [1 << (shift + j % QUAD) for j in range(32)])
        is_set = builder.icmp_unsigned("!=", builder.and_(spread, masks), zero)
        out.append(builder.select(is_set, sixteen, zero))
    return out[0], out[1]


def crumbs(builder: ir.IRBuilder, plane: ir.Value, load: int) -> tuple[ir.Value, ir.Value]:
    """A 6-bit load's two high bits (qtiles.to_dot_codes6: the crumb plane's 32 bytes, bits 4p, 4p + 1 for load
    p's low nibbles and 4p + 2, 4p + 3 for its high ones) as two vectors of 16 * crumb beside the low and high
    nibbles: a shift by a constant and a mask each, the same for every byte (32 or, for a tile pair, 64)."""
    vector = plane.type
    mask = ir.Constant(vector, [0x30] * vector.count)
    out = []
    for bit in (4 * load, 4 * load + 2):  # the crumb's lowest bit, moved to bit 4
        moved = plane
        if bit < 4:
            moved = builder.shl(plane, ir.Constant(vector, [4 - bit] * vector.count))
        elif bit > 4:
            moved = builder.lshr(plane, ir.Constant(vector, [bit - 4] * vector.count))
        out.append(builder.and_(moved, mask))
    return out[0], out[1]


def _make_tile_product(rows: int):
    # independent accumulators per row of x, so that an FMA's latency (4 cycles) does not serialise the
    # loop: unroll * rows chains in flight; codes per group (16 or 32 or, for nibbles, 8 or 16) divide by it
    unroll = UNROLL[rows]

    @intrinsic
    def tile_product(typingctx, x, m0, xsum, codes, scales, offsets, base_scales, base_offsets, group, t, out):
        signed = codes.dtype == types.int8
        if not signed and codes.dtype != types.uint8:
            return None
        # packed codes: 5-bit ones uint8 [T, G, 5, 32] (four planes of nibbles, one of bits), 6-bit ones int8
        # [T, G, 3, 32] (two planes of nibbles, one of crumbs)
        packed = codes.ndim == 4
        if scales.dtype not in (types.float32, types.int8) or offsets.dtype not in (types.float32, types.int8):
            return None
        factored, factored_offsets = scales.dtype == types.int8, offsets.dtype == types.int8
        sig = types.void(x, m0, xsum, codes, scales, offsets, base_scales, base_offsets, group, t, out)

        def codegen(context, builder, signature, args):
            xa, m0v, xsa, ca, sa, oa, bsa, boa, groupv, tv, outa = args
            arrays = [cgutils.create_struct_proxy(ty)(context, builder, value=v)
                      for ty, v in zip([signature.args[i] for i in (0, 2, 3, 4, 5, 6, 7, 10)],
                                       (xa, xsa, ca, sa, oa, bsa, boa, outa))]
            xs, sums, cs, ss, os_, bss, bos, outs = arrays
            intp = context.get_value_type(types.intp)
            width = cgutils.unpack_tuple(builder, xs.shape)[1]
            code_shape = cgutils.unpack_tuple(builder, cs.shape)
            group_stride = builder.mul(code_shape[2], code_shape[3]) if packed else None  # planes of 32 bytes
            code_row = builder.mul(code_shape[1], group_stride) if packed else code_shape[1]
            scale_row = cgutils.unpack_tuple(builder, ss.shape)[1]
            n_groups = builder.udiv(scale_row, ir.Constant(intp, LANES))
            sum_row = cgutils.unpack_tuple(builder, sums.shape)[1]
            has_offsets = builder.icmp_signed(">", cgutils.unpack_tuple(builder, os_.shape)[0],
                                              ir.Constant(intp, 0))
            n_out = cgutils.unpack_tuple(builder, outs.shape)[1]
            group_v = builder.sext(groupv, intp) if groupv.type != intp else groupv
            m0_v = builder.sext(m0v, intp) if m0v.type != intp else m0v
            t_v = builder.sext(tv, intp) if tv.type != intp else tv
            per_group = group_v if signed else builder.lshr(group_v, ir.Constant(intp, 1))
            code_base = builder.gep(cs.data, [builder.mul(t_v, code_row)])
            scale_base = builder.gep(ss.data, [builder.mul(t_v, scale_row)])
            offset_base = builder.gep(os_.data, [builder.mul(t_v, scale_row)])
            base_row = cgutils.unpack_tuple(builder, bss.shape)[1]
            base_scale_row = builder.gep(bss.data, [builder.mul(t_v, base_row)])
            base_offset_row = builder.gep(bos.data, [builder.mul(t_v, base_row)])
            # groups per super-block (8 or 16), read only when factored
            per = builder.udiv(n_groups, builder.udiv(base_row, ir.Constant(intp, LANES))) \
                if factored or factored_offsets else None

            def lane_values(kind_int8: bool, row: ir.Value, base: ir.Value, lane0: ir.Value, g: ir.Value) -> ir.Value:
                """The eight rows' scale (or offset) of group g as float32 lanes: stored, or a K type's
                factored int times its super-block's base (the same float32 value, exact)."""
                if kind_int8:
                    ints = builder.sitofp(builder.sext(_load(builder, row, lane0, _V8I8), _V8I32), _V8F)
                    block0 = builder.mul(builder.udiv(g, per), ir.Constant(intp, LANES))
                    return builder.fmul(_load(builder, base, block0, _V8F), ints)
                return _load(builder, row, lane0, _V8F)
            x_rows = [builder.gep(xs.data, [builder.mul(builder.add(m0_v, ir.Constant(intp, i)), width)])
                      for i in range(rows)]
            sum_rows = [builder.gep(sums.data, [builder.mul(builder.add(m0_v, ir.Constant(intp, i)), sum_row)])
                        for i in range(rows)]

            def add_column(w: ir.Value, k: ir.Value, u: int) -> None:
                """acc[i][u] += x[i, k] * w for every row i of x (w: the column's eight codes as floats)."""
                for i in range(rows):
                    xk = _broadcast(builder, builder.load(builder.gep(x_rows[i], [k])))
                    a = acc[i][u]
                    builder.store(_fma(builder, xk, w, builder.load(a)), a)

            def byte_group(codes_g: ir.Value, k0: ir.Value) -> None:
                """A group of int8 codes (a column's eight rows in 8 bytes) or nibbles (two columns a byte:
                weight j low, j + group / 2 high)."""
                steps = builder.udiv(per_group, ir.Constant(intp, unroll))
                with cgutils.for_range(builder, steps) as j_loop:
                    for u in range(unroll):
                        j = builder.add(builder.mul(j_loop.index, ir.Constant(intp, unroll)), ir.Constant(intp, u))
                        raw = _load(builder, codes_g, builder.mul(j, ir.Constant(intp, LANES)), _V8I8)
                        k = builder.add(k0, j)
                        if signed:
                            add_column(builder.sitofp(builder.sext(raw, _V8I32), _V8F), k, u)
                        else:
                            wide = builder.zext(raw, _V8I32)
                            low = builder.and_(wide, ir.Constant(_V8I32, [15] * LANES))
                            add_column(builder.uitofp(low, _V8F), k, u)
                            high = builder.lshr(wide, ir.Constant(_V8I32, [4] * LANES))
                            add_column(builder.uitofp(high, _V8F), builder.add(k, half), u)

            def packed_group(codes_g: ir.Value, k0: ir.Value) -> None:
                """A group of 5-bit codes (32 columns) or 6-bit ones (16) as qtiles.to_packed_codes lays them
                out (the integer kernels' layout: one copy of the codes serves both modes). Load q's 32 bytes
                are row r's columns 4q + c (low nibbles) and half + 4q + c (high) in byte 4r + c, so as eight
                int32 lanes, lane r is row r: a shift by 8c and a mask give column c's code for the eight
                rows, no shuffle. The fifth bits (`fifth_bits`) or the crumbs (`crumbs`) are ORed in first;
                6-bit codes are code + 32: the bias is taken off the 32 bytes, then each column's byte is
                sign-extended (a shift left and an arithmetic one right)."""
                nibble, byte = ir.Constant(_V32I8, [15] * 32), ir.Constant(_V8I32, [255] * LANES)
                half = 8 if signed else 16  # the high nibbles' columns are this far on
                crumb_plane = _load(builder, codes_g, ir.Constant(intp, CRUMB_PLANE * LANES * QUAD), _V32I8) \
                    if signed else None
                # a loop over the loads, not unrolled (its trip count is the array's): written out, LLVM
                # hoisted every column's broadcasts of x ahead of the products and spilled them (a K type's
                # 6-bit codes at four rows of x ran at 0.39x the int8 codes' speed, bench_qdot_rows.py)
                with cgutils.for_range(builder, builder.sub(code_shape[2], ir.Constant(intp, 1))) as q_loop:
                    q = q_loop.index
                    plane = _load(builder, codes_g, builder.mul(q, ir.Constant(intp, LANES * QUAD)), _V32I8)
                    if signed:  # load q's crumbs moved to bits 0..3 (a shift by 4q, the same for every byte)
                        by = builder.trunc(builder.shl(q, ir.Constant(intp, 2)), ir.IntType(8))
                        shift = builder.shuffle_vector(
                            builder.insert_element(ir.Constant(_V32I8, ir.Undefined), by, ir.Constant(_I32, 0)),
                            ir.Constant(_V32I8, ir.Undefined), ir.Constant(ir.VectorType(_I32, 32), [0] * 32))
                        low_bits, high_bits = crumbs(builder, builder.lshr(crumb_plane, shift), 0)
                    else:
                        low_bits, high_bits = fifth_bits(builder, builder.gep(codes_g, [builder.add(
                            ir.Constant(intp, BIT_PLANE * LANES * QUAD), builder.mul(q, ir.Constant(intp, LANES)))]))
                    values = [builder.or_(builder.and_(plane, nibble), low_bits),
                              builder.or_(builder.lshr(plane, ir.Constant(_V32I8, [4] * 32)), high_bits)]
                    if signed:
                        values = [builder.sub(v, ir.Constant(_V32I8, [SMALL_BIAS] * 32)) for v in values]
                    low, high = (builder.bitcast(v, _V8I32) for v in values)
                    kq = builder.add(k0, builder.mul(q, ir.Constant(intp, QUAD)))
                    for c in range(QUAD):
                        k = builder.add(kq, ir.Constant(intp, c))
                        for codes4, column in ((low, k), (high, builder.add(k, ir.Constant(intp, half)))):
                            if signed:  # byte c of each lane, sign-extended
                                top = builder.shl(codes4, ir.Constant(_V8I32, [24 - 8 * c] * LANES)) \
                                    if c < QUAD - 1 else codes4
                                code = builder.ashr(top, ir.Constant(_V8I32, [24] * LANES))
                            else:
                                shifted = builder.lshr(codes4, ir.Constant(_V8I32, [8 * c] * LANES)) if c else codes4
                                code = builder.and_(shifted, byte) if c < QUAD - 1 else shifted
                            add_column(builder.sitofp(code, _V8F), column, c % unroll)

            zero = ir.Constant(_V8F, [0.0] * LANES)
            total = [cgutils.alloca_once_value(builder, zero) for _ in range(rows)]
            acc = [[cgutils.alloca_once_value(builder, zero) for _ in range(unroll)] for _ in range(rows)]
            half = builder.lshr(group_v, ir.Constant(intp, 1))
            with cgutils.for_range(builder, n_groups) as g_loop:
                g = g_loop.index
                for row_acc in acc:
                    for a in row_acc:
                        builder.store(zero, a)
                k0 = builder.mul(g, group_v)
                if packed:
                    packed_group(builder.gep(code_base, [builder.mul(g, group_stride)]), k0)
                else:
                    byte_group(builder.gep(code_base, [builder.mul(builder.mul(g, per_group),
                                                                   ir.Constant(intp, LANES))]), k0)
                lane0 = builder.mul(g, ir.Constant(intp, LANES))
                scale = lane_values(factored, scale_base, base_scale_row, lane0, g)
                for i in range(rows):
                    dot = builder.load(acc[i][0])
                    for a in acc[i][1:]:
                        dot = builder.fadd(dot, builder.load(a))
                    builder.store(_fma(builder, scale, dot, builder.load(total[i])), total[i])
                with builder.if_then(has_offsets, likely=True):
                    offset = lane_values(factored_offsets, offset_base, base_offset_row, lane0, g)
                    for i in range(rows):
                        xsum_g = _broadcast(builder, builder.load(builder.gep(sum_rows[i], [g])))
                        builder.store(_fma(builder, offset, xsum_g, builder.load(total[i])), total[i])
            n0 = builder.mul(t_v, ir.Constant(intp, LANES))
            for i in range(rows):
                row = builder.gep(outs.data, [builder.add(builder.mul(builder.add(m0_v, ir.Constant(intp, i)),
                                                                      n_out), n0)])
                builder.store(builder.load(total[i]), builder.bitcast(row, _V8F.as_pointer()), align=1)
            return context.get_dummy_value()

        return sig, codegen

    return tile_product


tile_product_1 = _make_tile_product(1)
tile_product_2 = _make_tile_product(2)
tile_product_3 = _make_tile_product(3)
tile_product_4 = _make_tile_product(4)
