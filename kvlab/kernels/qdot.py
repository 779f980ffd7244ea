"""Integer dot products: activations rounded to int8 against a tile's codes, four products an instruction.

The float kernels (qsimd.py) widen, convert and multiply every code by a float activation: about half an
instruction a weight whatever its type, which bounds batch-1 decode by instructions on these CPUs and
batch 16 by float FMAs. llama.cpp instead rounds each group of activations to int8 (one float scale a
group) and multiplies codes by them as integers. kvlab does the same only when asked (the model's
`activations="q8"`; kvlab/model/act_quant.py defines the rounding): the products are then exact
integers, so the result equals `round_activations(x) @ dequantize(W).T` up to float32 summation order.

Layout: the codes of a tile ([T, G, per-group bytes * 8], model/qtiles.py's `to_dot_tiles`) hold, per
group, quads of four consecutive columns for each of the eight rows: one 32-byte load is 8 rows x 4
columns, and `vpdpbusd` (AVX-512 VNNI / AVX-VNNI) multiplies those 32 unsigned bytes by four int8
activations broadcast to every lane and adds each row's four products into that row's int32 lane: lanes
are rows, as in the float kernels. vpdpbusd wants one unsigned operand: nibbles (Q4_0, Q4_1, Q4_K) are
0..15 already (low nibbles, then `>> 4` for the high ones); int8 codes are flipped to `code + 128` by an
XOR with 0x80 (a K type's small ones, Q6_K's -32..31 and Q3_K's, made `code + 32` by an add), and the
group's `bias * sum(q)` is taken off before the int32 sum becomes float: bias 128 for int8 codes (32 for
small ones), 8 for Q4_0's nibbles, whose offset (-8 * scale) is folded in so that it is not read, else 0.
Per group and row: `total = fma(scale, dx * float(dot - bias * sum(q)), total)`, then
`+ offset * dx * sum(q)`. No int32 sum can overflow: a group of 32 is at most 32 * 255 * 127. Scales are
float16 where the file's are (every type but the K types): 2 bytes a group and 8 rows, widened by one
instruction (vcvtph2ps). A K type's scale is a product (float16 d times a 6- or 8-bit sub-block scale):
it comes as an int8 a group times a float32 base a super-block (model/qtiles.factor_scales), and the
kernel rebuilds the same float32 scale as base * float(int), exact: 1 byte a group and row instead of 4
(Q4_K's scales and offsets were a third of its bytes), three instructions per group shared by the rows.
5-bit codes (Q5_0, Q5_1, Q5_K) come as nibbles and a plane of their fifth bits ([T, G, 5, 32] per group,
model/qtiles.to_dot_codes5; the array's fourth axis marks them): per load `fifth_bits` turns 8 bytes into 16s
ORed into the low and high nibbles (a byte shuffle, and, compare, select, shared by the rows), and the codes
go in unsigned, 0..31, Q5_0's bias 16 taken off as Q4_0's 8 is: 5 bits a weight read, as in the file.
Q6_K's 6-bit codes come as nibbles and a plane of crumbs ([T, G, 3, 32] int8, model/qtiles.to_dot_codes6):
per load the crumb plane shifted by a constant and masked (`crumbs`) is ORed into the low and high nibbles,
and the codes go in as code + 32, 0..63, as the small codes below: 6 bits a weight read, as in the file.

Where the CPU has AVX2 but no VNNI (Zen 3, Haswell to Skylake: `MADD`), llama.cpp's AVX2 arithmetic:
`vpmaddubsw` makes 32 byte products into 16-bit pair sums and `vpmaddwd` by ones adds each row's four.
Nibbles (0..15) and small codes (code + 32, 0..63) go in as they are (a pair sum is at most 2 * 63 * 127:
in 16 bits, two loads an accumulator, they take one vpmaddwd a group, not one a load, and no vpsignb:
Q6_K's products 1.18x faster at 4 and 16 rows than by the sign trick, bench_qdot_rows.py on Zen 3). 8-bit
codes go in unflipped, by the sign trick: |code| (unsigned, shared by the rows) times the activation given
the code's sign (`vpsignb`), so a pair sum is at most 2 * 128 * 127 and never saturates, and there is no
bias to take off. Elsewhere (no AVX2) the same IR multiplies widened int32 vectors and adds the four
columns with shuffles. Integer sums, so every path gives the same int32 totals and bits. The choice is made from the
features numba compiles for (NUMBA_CPU_NAME / NUMBA_CPU_FEATURES or the host's).

`tile_dot_R(xq, m0, dx, qbias, fsum, codes, scales, offsets, base_scales, base_offsets, t, out)` (R = 1..4
or 8 rows of x) writes out[m0:m0+R, 8t:8t+8]: xq int8 [M, K], dx float32 [M, G] the groups' scales, qbias
int32 [M, G] = -bias * the sums of the int8 values (added to each group's int32 dot: a broadcast from
memory and an add, where the subtraction of a positive one took four instructions), fsum float32 [M, G] =
dx * sum (read only when offsets has rows), codes int8 or uint8 (nibbles) [T, G, bytes], scales float32,
float16 bits (uint16) or factored int8, offsets float32 or factored int8 [T, G*8] (as for the float
kernels), base_scales / base_offsets float32 [T, SB*8] the factored ones' bases (no columns otherwise).
Per group and row the epilogue is four vector instructions: add qbias, convert, multiply by dx, fma by
the scale into the row's total; every R computes a row the same way, so a row's bits do not depend on the rows
beside it (tests/test_batch_invariant.py). Eight rows at once (where AVX-512 gives 32 registers: WIDE)
read a tile's codes once for eight rows and keep eight independent vpdpbusd chains in flight: 1.2-1.4x
the four-row blocks' products at 8-16 rows on Zen 4 (bench/bench_qdot_rows.py). From 16 rows of x, where
the CPU has AVX-512 VNNI and BW (PAIRS), two neighbouring tiles go through one zmm register: their codes
loaded side by side (64 bytes), each x broadcast, vpdpbusd, conversion and fma then serving 16 output
rows instead of 8. Zen 4 runs a zmm vpdpbusd in two halves, so the integer peak is the same; what pairs
save is the instructions around it (the broadcasts and the per-group epilogue were half of them):
16 rows of SmolLM2's output and MLP products 1.16x faster warm, a batch-16 step 0.74-0.86x the time (A/B
runs in the README and the commits). Each lane's arithmetic is the single tile's, so the bits are too.
Below 16 rows each code is used once per step, the products stream the weights from memory, and pairs
measured slower there (1.04x the step time at batch 8, 1.2-1.4x at 1 and 4): qgemv.PAIR_MIN_ROWS keeps
those one tile a register.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils, config
from numba.extending import intrinsic

from kvlab.kernels.layout import BIT_PLANE, CRUMB_PLANE, LANES, QUAD, SMALL_BIAS
from kvlab.kernels.qsimd import _fma, crumbs, fifth_bits

UNROLL = 2  # independent accumulators per row of x (the quad loop steps by this; a 6-bit group's two loads)
_I8 = ir.IntType(8)
_I16 = ir.IntType(16)
_I32 = ir.IntType(32)
_F32 = ir.FloatType()
_V8F = ir.VectorType(_F32, LANES)
_V8H = ir.VectorType(ir.HalfType(), LANES)
_V8I16 = ir.VectorType(ir.IntType(16), LANES)
_V8I8 = ir.VectorType(_I8, LANES)
_V8I32 = ir.VectorType(_I32, LANES)
_V16I16 = ir.VectorType(_I16, 2 * LANES)
_V32I8 = ir.VectorType(_I8, LANES * QUAD)


def _target_features() -> str:
    """The feature string numba compiles for ('+avx2,+avx512vnni,...')."""
    if config.CPU_FEATURES:
        return config.CPU_FEATURES
    if config.CPU_NAME and config.CPU_NAME != "host":
        return ""
    import llvmlite.binding as llvm

    return llvm.get_host_cpu_features().flatten()


def has_vnni() -> bool:
    """Whether vpdpbusd on ymm registers is available to compiled code (AVX-512 VNNI + VL, or AVX-VNNI)."""
    features = set(_target_features().split(","))
    return "+avxvnni" in features or {"+avx512vnni", "+avx512vl"} <= features


VNNI = has_vnni()
# eight rows of x at once need ~20 vector registers: AVX-512 has 32 (ymm16-31 with VL), AVX2 16
WIDE = "+avx512vl" in set(_target_features().split(","))
# two tiles in one zmm register (16 lanes): vpdpbusd on zmm and byte operations on 64 lanes
PAIRS = {"+avx512f", "+avx512bw", "+avx512vnni"} <= set(_target_features().split(","))
# AVX2 without VNNI (Zen 3, Haswell-Skylake): vpmaddubsw + vpmaddwd, for 8-bit codes by the sign trick
# (`_dpbusd`), where the generic IR (widen to int32, vpmulld, column shuffles) spent ~2.5 instructions a product
MADD = not VNNI and "+avx2" in set(_target_features().split(","))


def _splat(builder: ir.IRBuilder, value: ir.Value, vector: ir.VectorType) -> ir.Value:
    one = builder.insert_element(ir.Constant(vector, ir.Undefined), value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(one, ir.Constant(vector, ir.Undefined),
                                  ir.Constant(ir.VectorType(_I32, vector.count), [0] * vector.count))


def _dpbusd(builder: ir.IRBuilder, acc: ir.Value, codes: ir.Value, x4: ir.Value, unsigned: bool = False,
            magnitudes: ir.Value | None = None) -> ir.Value:
    """acc[r] + sum_{c<4} codes[4r + c] (unsigned) * x4 bytes[c] (signed), per int32 lane r (8 lanes, or 16
    for a tile pair: `vpdpbusd` on zmm). Where MADD (AVX2 without VNNI), by `vpmaddubsw` (32 byte products
    into 16-bit pair sums) and `vpmaddwd` by ones (each row's four): `unsigned` codes as they are (nibbles
    0..15, 5-bit codes 0..31, small codes + 32 up to 63), a pair sum at most 2 * 63 * 127; 8-bit codes as
    signed `codes` with their `magnitudes` (|code|, `magnitude`), the activations given each code's sign
    (`vpsignb`): sum codes[4r + c] * x4 bytes[c], signed, a pair sum at most 2 * 128 * 127 (activations are
    within +-127), never saturated; an `acc` of 16 int16 lanes (`nibble_pairs`) takes the pair sums as they
    are. Integer sums, so every path gives the same int32 totals."""
    if MADD and codes.type.count == LANES * QUAD and (unsigned or magnitudes is not None):
        splat = builder.bitcast(_splat(builder, x4, _V8I32), _V32I8)
        operand = codes
        if magnitudes is not None:
            operand, splat = magnitudes, _psign(builder, splat, codes)
        name = "llvm.x86.avx2.pmadd.ub.sw"
        fn = builder.module.globals.get(name) or ir.Function(builder.module, ir.FunctionType(_V16I16, [_V32I8] * 2),
                                                             name=name)
        pairs = builder.call(fn, [operand, splat])
        if acc.type == _V16I16:  # nibbles' pair sums kept in 16 bits (`nibble_pairs`)
            return builder.add(acc, pairs)
        return builder.add(acc, widen_pairs(builder, pairs))
    lanes = acc.type.count
    x4v = _splat(builder, x4, ir.VectorType(_I32, lanes))
    if VNNI:
        module = builder.module
        name = "llvm.x86.avx512.vpdpbusd." + str(32 * lanes)
        vector = ir.VectorType(_I32, lanes)
        fn = module.globals.get(name) or ir.Function(module, ir.FunctionType(vector, [vector] * 3), name=name)
        return builder.call(fn, [acc, builder.bitcast(codes, vector), x4v])
    wide_type = ir.VectorType(_I32, lanes * QUAD)
    wide = builder.mul(builder.zext(codes, wide_type),
                       builder.sext(builder.bitcast(x4v, ir.VectorType(_I8, lanes * QUAD)), wide_type))
    for c in range(QUAD):
        column = builder.shuffle_vector(wide, wide, ir.Constant(ir.VectorType(_I32, lanes),
                                                                [QUAD * r + c for r in range(lanes)]))
        acc = builder.add(acc, column)
    return acc


def _psign(builder: ir.IRBuilder, a: ir.Value, b: ir.Value) -> ir.Value:
    """`vpsignb`: each byte of a negated where b's is negative, zeroed where b's is zero (32 bytes)."""
    name = "llvm.x86.avx2.psign.b"
    fn = builder.module.globals.get(name) or ir.Function(builder.module, ir.FunctionType(_V32I8, [_V32I8] * 2),
                                                         name=name)
    return builder.call(fn, [a, b])


def magnitude(builder: ir.IRBuilder, codes: ir.Value) -> ir.Value:
    """|code| of 32 signed bytes, read as unsigned (|-128| is 128), for the sign trick (`_dpbusd`)."""
    return _psign(builder, codes, codes)


def widen_pairs(builder: ir.IRBuilder, pairs: ir.Value) -> ir.Value:
    """16 int16 pair sums (a tile's 8 rows x 2) as each row's int32 sum: `vpmaddwd` by ones."""
    return _madd_wd(builder, pairs, ir.Constant(_V16I16, [1] * 16))


def nibble_pairs(accs: int, unsigned: bool, pair: bool) -> bool:
    """Whether a tile's accumulators hold 16-bit pair sums (16 lanes, two a row), widened to int32 once a
    group (`widen_pairs`) rather than once a product instruction: where MADD, for codes that go in unsigned
    as they are (all but 8-bit ones), when a row of x has two accumulators (`accs`). A nibbles' pair sum is
    at most 2 * 15 * 127 = 3810, and a group (model/qtiles.NIBBLE_GROUP_MAX = 32 columns, four a sum) gives
    each of the two accumulators four: their 16-bit sum is at most 30480 < 32767, so the two are added in 16
    bits and widened once a row and group; 5-bit codes (0..31, model/qtiles.to_dot_codes5) make pair sums of
    at most 2 * 31 * 127 = 7874, four an accumulator (31496), and small codes (code + 32, 0..63) at most
    2 * 63 * 127 = 16002, two an accumulator (a group of layout.SMALL_GROUP_MAX = 16 columns: 32004), so
    theirs are widened apart. Saves a vpmaddwd per product instruction and makes the add 16-bit."""
    return MADD and unsigned and not pair and accs >= 2


def _madd_wd(builder: ir.IRBuilder, a: ir.Value, b: ir.Value) -> ir.Value:
    """`vpmaddwd`: int32 lane j = a[2j] * b[2j] + a[2j + 1] * b[2j + 1] over 16 int16 lanes each (exact)."""
    name = "llvm.x86.avx2.pmadd.wd"
    fn = builder.module.globals.get(name) or ir.Function(builder.module, ir.FunctionType(_V8I32, [_V16I16] * 2),
                                                         name=name)
    return builder.call(fn, [a, b])


def _concat(builder: ir.IRBuilder, a: ir.Value, b: ir.Value) -> ir.Value:
    """Two vectors of n lanes as one of 2n (a's lanes first): a tile pair's halves side by side."""
    n = a.type.count
    return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(_I32, 2 * n), list(range(2 * n))))


def _load(builder: ir.IRBuilder, base: ir.Value, index: ir.Value, ty: ir.Type) -> ir.Value:
    return builder.load(builder.bitcast(builder.gep(base, [index]), ty.as_pointer()), align=1)


def _make_tile_dot(rows: int, pair: bool = False):
    """The intrinsic for `rows` rows of x against one tile (8 output rows in the lanes of a ymm register),
    or, `pair`, against tiles t and t + 1 at once (16 output rows in a zmm register, AVX-512: each x
    broadcast, epilogue instruction and loop step then serves twice the weights; every lane's arithmetic
    is the single tile's, so the bits are too)."""
    lanes = LANES * (2 if pair else 1)
    vf, vi32 = ir.VectorType(_F32, lanes), ir.VectorType(_I32, lanes)
    vbytes = ir.VectorType(_I8, lanes * QUAD)
    # vpdpbusd's latency is ~4 cycles at two a cycle: eight independent chains keep it busy, so a row of
    # x gets 8 / rows accumulators (int32 sums are exact: how many there are changes no bit), and the
    # loop takes enough quads a step to feed them
    accs = 1 if rows >= 8 else 2

    @intrinsic
    def tile_dot(typingctx, xq, m0, dx, qbias, fsum, codes, scales, offsets, base_scales, base_offsets, t, out):
        signed = codes.dtype == types.int8
        if not signed and codes.dtype != types.uint8:
            return None
        # packed codes: 5-bit ones uint8 [T, G, 5, 32] (four planes of nibbles, one of bits), 6-bit ones
        # int8 [T, G, 3, 32] (two planes of nibbles, one of crumbs; code + 32, as small codes go in)
        packed = codes.ndim == 4
        five, six = packed and not signed, packed and signed
        # uint16: float16 bits (numba has no float16); int8: a K type's factored scales (times base_scales)
        if scales.dtype not in (types.uint16, types.float32, types.int8) or qbias.dtype != types.int32:
            return None
        half_scales = scales.dtype == types.uint16
        factored = scales.dtype == types.int8
        # a K type's small signed codes (int8 beside factored scales: Q3_K; Q6_K's unless packed) read as
        # code + 32, unsigned (layout.SMALL_BIAS; model/quantized.py refuses others), so AVX2 needs no sign
        # trick for them; 6-bit packed codes are code + 32 already, whatever their scales
        small = signed and factored and not six
        factored_offsets = offsets.dtype == types.int8
        sig = types.void(xq, m0, dx, qbias, fsum, codes, scales, offsets, base_scales, base_offsets, t, out)

        def codegen(context, builder, signature, args):
            xa, m0v, dxa, qba, fsa, ca, sa, oa, bsa, boa, tv, outa = args
            # MADD takes 8-bit codes unflipped (the sign trick): their dot has no code + 128 to take off. Read
            # here, at code generation, as `_dpbusd` reads MADD (numba caches an intrinsic's typing)
            sign_trick = MADD and signed and not pair and not small and not six
            unsigned = not signed or small or six  # the codes go into the products as unsigned bytes
            in_pairs = nibble_pairs(accs, unsigned, pair)
            xs, dxs, qbs, fss, cs, ss, os_, bss, bos, outs = [
                cgutils.create_struct_proxy(ty)(context, builder, value=v)
                for ty, v in zip([signature.args[i] for i in (0, 2, 3, 4, 5, 6, 7, 8, 9, 11)],
                                 (xa, dxa, qba, fsa, ca, sa, oa, bsa, boa, outa))]
            intp = context.get_value_type(types.intp)

            def const(v: int) -> ir.Value:
                return ir.Constant(intp, v)

            width = cgutils.unpack_tuple(builder, xs.shape)[1]
            if packed:  # the nibbles' 4 (5-bit) or 2 (6-bit) planes of 32 bytes a group, then its bits or crumbs
                _, n_groups, planes, plane_bytes = cgutils.unpack_tuple(builder, cs.shape)
                group_bytes = const((CRUMB_PLANE if six else BIT_PLANE) * LANES * QUAD)
                group_stride = builder.mul(planes, plane_bytes)
            else:
                _, n_groups, group_bytes = cgutils.unpack_tuple(builder, cs.shape)
                group_stride = group_bytes
            scale_row = cgutils.unpack_tuple(builder, ss.shape)[1]
            sum_row = cgutils.unpack_tuple(builder, dxs.shape)[1]
            n_out = cgutils.unpack_tuple(builder, outs.shape)[1]
            has_offsets = builder.icmp_signed(">", cgutils.unpack_tuple(builder, os_.shape)[0], const(0))
            m0_v = builder.sext(m0v, intp) if m0v.type != intp else m0v
            t_v = builder.sext(tv, intp) if tv.type != intp else tv
            quads = builder.udiv(group_bytes, const(LANES * QUAD))
            group = builder.udiv(group_bytes, const(LANES if signed and not six else LANES // 2))  # columns a group
            half = builder.lshr(group, const(1))
            code_base = builder.gep(cs.data, [builder.mul(builder.mul(t_v, n_groups), group_stride)])
            scale_base = builder.gep(ss.data, [builder.mul(t_v, scale_row)])
            offset_base = builder.gep(os_.data, [builder.mul(t_v, scale_row)])
            base_row = cgutils.unpack_tuple(builder, bss.shape)[1]
            base_scale_row = builder.gep(bss.data, [builder.mul(t_v, base_row)])
            base_offset_row = builder.gep(bos.data, [builder.mul(t_v, base_row)])
            # groups per super-block (a power of two: 8 or 16), as a shift; read only when factored
            per_shift = None
            if factored or factored_offsets:
                per = builder.udiv(n_groups, builder.udiv(base_row, const(LANES)))
                i64 = ir.IntType(64)
                cttz = builder.module.globals.get("llvm.cttz.i64") or ir.Function(
                    builder.module, ir.FunctionType(i64, [i64, ir.IntType(1)]), name="llvm.cttz.i64")
                per_shift = builder.call(cttz, [per, ir.Constant(ir.IntType(1), 0)])

            def half_values(kind_int8: bool, kind_half: bool, row: ir.Value, base: ir.Value, lane0: ir.Value,
                            g: ir.Value) -> ir.Value:
                """One tile's eight rows' scale (or offset) of group g as float32 lanes."""
                if kind_int8:  # base (one per super-block and row) * the group's int: the float32 scale, exact
                    ints = builder.sitofp(builder.sext(_load(builder, row, lane0, _V8I8), _V8I32), _V8F)
                    block0 = builder.mul(builder.lshr(g, per_shift), const(LANES))
                    return builder.fmul(_load(builder, base, block0, _V8F), ints)
                if kind_half:
                    return builder.fpext(builder.bitcast(_load(builder, row, lane0, _V8I16), _V8H), _V8F)
                return _load(builder, row, lane0, _V8F)

            def lane_values(kind_int8: bool, kind_half: bool, row: ir.Value, base: ir.Value, lane0: ir.Value,
                            g: ir.Value) -> ir.Value:
                """The tile's (or the pair's) rows' scale (or offset) of group g as float32 lanes."""
                first = half_values(kind_int8, kind_half, row, base, lane0, g)
                if not pair:
                    return first
                second = half_values(kind_int8, kind_half, builder.gep(row, [scale_row]),
                                     builder.gep(base, [base_row]), lane0, g)
                return _concat(builder, first, second)
            row_ix = [builder.add(m0_v, const(i)) for i in range(rows)]
            x_rows = [builder.gep(xs.data, [builder.mul(r, width)]) for r in row_ix]
            sum_ix = [builder.mul(r, sum_row) for r in row_ix]
            zero_i = ir.Constant(_V16I16, [0] * 16) if in_pairs else ir.Constant(vi32, [0] * lanes)
            zero_f = ir.Constant(vf, [0.0] * lanes)
            total = [cgutils.alloca_once_value(builder, zero_f) for _ in range(rows)]
            acc = [[cgutils.alloca_once_value(builder, zero_i) for _ in range(accs)] for _ in range(rows)]
            flip = ir.Constant(vbytes, [0x80] * (lanes * QUAD))
            plus_small = ir.Constant(vbytes, [SMALL_BIAS] * (lanes * QUAD))
            low_mask = ir.Constant(vbytes, [0x0F] * (lanes * QUAD))
            four = ir.Constant(vbytes, [4] * (lanes * QUAD))
            tile_bytes = builder.mul(n_groups, group_stride)  # the next tile's codes are this far on
            with cgutils.for_range(builder, n_groups) as g_loop:
                g = g_loop.index
                for row_acc in acc:
                    for a in row_acc:
                        builder.store(zero_i, a)
                codes_g = builder.gep(code_base, [builder.mul(g, group_stride)])
                k0 = builder.mul(g, group)
                def products(q: ir.Value, first: int, load: int) -> int:
                    """The products of quad load q into the accumulators from `first` on (round robin). `load`:
                    q as a constant where the loop runs once (6-bit codes: two loads a group, UNROLL)."""
                    at = builder.mul(q, const(LANES * QUAD))
                    raw = _load(builder, codes_g, at, _V32I8)
                    if pair:
                        raw = _concat(builder, raw, _load(builder, builder.gep(codes_g, [tile_bytes]), at, _V32I8))
                    k = builder.add(k0, builder.mul(q, const(QUAD)))
                    magnitudes = None
                    if signed and sign_trick:  # the codes as they are, |code| shared by the rows
                        parts, magnitudes = [(raw, k)], magnitude(builder, raw)
                    elif small:
                        parts = [(builder.add(raw, plus_small), k)]
                    elif signed and not six:
                        parts = [(builder.xor(raw, flip), k)]
                    else:
                        parts = [(builder.and_(raw, low_mask), k), (builder.lshr(raw, four), builder.add(k, half))]
                    if five:  # each nibble's fifth bit, as 16, from the group's plane of bits
                        bits = fifth_bits(builder, builder.gep(codes_g, [builder.add(group_bytes, builder.mul(
                            q, const(LANES)))]))
                        if pair:
                            second = fifth_bits(builder, builder.gep(codes_g, [builder.add(
                                tile_bytes, builder.add(group_bytes, builder.mul(q, const(LANES))))]))
                            bits = tuple(_concat(builder, a, b) for a, b in zip(bits, second))
                        parts = [(builder.or_(c, b), kk) for (c, kk), b in zip(parts, bits)]
                    if six:  # each nibble's two high bits, as 16s, from the group's plane of crumbs
                        plane = _load(builder, codes_g, group_bytes, _V32I8)
                        if pair:
                            second = _load(builder, codes_g, builder.add(tile_bytes, group_bytes), _V32I8)
                            plane = _concat(builder, plane, second)
                        parts = [(builder.or_(c, b), kk) for (c, kk), b in zip(parts, crumbs(builder, plane, load))]
                    for codes4, kk in parts:
                        for i in range(rows):
                            a = acc[i][first % accs]
                            x4 = _load(builder, x_rows[i], kk, _I32)
                            builder.store(_dpbusd(builder, builder.load(a), codes4, x4, unsigned, magnitudes), a)
                        first += 1
                    return first

                with cgutils.for_range(builder, builder.udiv(quads, const(UNROLL))) as q_loop:
                    first = 0
                    for u in range(UNROLL):
                        first = products(builder.add(builder.mul(q_loop.index, const(UNROLL)), const(u)), first, u)
                lane0 = builder.mul(g, const(LANES))
                scale = lane_values(factored, half_scales, scale_base, base_scale_row, lane0, g)
                for i in range(rows):
                    sums = [builder.load(a) for a in acc[i]]
                    if in_pairs and not (five or six or small):  # nibbles: one 16-bit sum a group, widened once
                        merged = sums[0]
                        for v in sums[1:]:
                            merged = builder.add(merged, v)
                        sums = [widen_pairs(builder, merged)]
                    elif in_pairs:  # 5-, 6-bit and small codes: each accumulator widened apart (`nibble_pairs`)
                        sums = [widen_pairs(builder, v) for v in sums]
                    dot = sums[0]
                    for v in sums[1:]:
                        dot = builder.add(dot, v)
                    at = builder.add(sum_ix[i], g)
                    # the codes went in as code + bias (int8 codes: + 128, but for the sign trick; small
                    # codes: + 32; Q4_0's nibbles: its -8 folded in): qbias = -bias * sum(q), added in int32
                    if not sign_trick:
                        dot = builder.add(dot, _splat(builder, builder.load(builder.gep(qbs.data, [at])), vi32))
                    dxi = _splat(builder, builder.load(builder.gep(dxs.data, [at])), vf)
                    builder.store(_fma(builder, scale, builder.fmul(builder.sitofp(dot, vf), dxi),
                                       builder.load(total[i])), total[i])
                with builder.if_then(has_offsets, likely=True):
                    offset = lane_values(factored_offsets, False, offset_base, base_offset_row, lane0, g)
                    for i in range(rows):
                        fs = _splat(builder, builder.load(builder.gep(fss.data, [builder.add(sum_ix[i], g)])), vf)
                        builder.store(_fma(builder, offset, fs, builder.load(total[i])), total[i])
            n0 = builder.mul(t_v, const(LANES))
            for i in range(rows):
                row = builder.gep(outs.data, [builder.add(builder.mul(row_ix[i], n_out), n0)])
                builder.store(builder.load(total[i]), builder.bitcast(row, vf.as_pointer()), align=1)
            return context.get_dummy_value()

        return sig, codegen

    return tile_dot


tile_dot_1 = _make_tile_dot(1)
tile_dot_2 = _make_tile_dot(2)
tile_dot_3 = _make_tile_dot(3)
tile_dot_4 = _make_tile_dot(4)
tile_dot_8 = _make_tile_dot(8)
tile_dot_8x2 = _make_tile_dot(8, pair=True)
