"""The layout the quantized kernels read: tiles of eight output rows interleaved, so SIMD lanes are rows.

`ggml_quants.unpack` gives each row's codes in order ([N, K] int8 or [N, K/2] nibbles) and one scale (and
offset) per group. A product kernel that walks one row at a time must sum each group's products across
the lanes of a register (a horizontal sum per group and row), which made the first kernels compute-bound
at 5-10x their roofline. Here rows 8t..8t+7 form tile t, stored group by group with the eight rows' codes
for one column side by side ([T, G, codes per group, 8], as llama.cpp's repacked "x8" layouts do): per
column the kernel widens 8 consecutive bytes and multiplies them by one broadcast x[k] (kernels/qsimd.py).
Scales and offsets go alike, [T, G, 8] float32 (a K type's factored: int8 with a float32 base per
super-block and row, `factor_scales`), so a group ends with one 8-lane multiply-add.

The N % 8 rows after the last whole tile stay in row order (`tail`), read by a plain per-row kernel; no
row is padded, so resident bytes are exactly those of the unpacked layout (ggml_quants's table). Tiling
is a transpose at load: 0.38 s CPU for SmolLM2-135M's Q8_0 matrices, 0.14 s for Q4_1 (one measurement
under load), and no extra bytes kept. Arrays are 2-D ([T, ...] flat per tile) so kernels index one tile with one row.
"""

from __future__ import annotations

import numpy as np

from kvlab.kernels.layout import BIT_PLANE, CRUMB_PLANE, LANES
from kvlab.model.ggml_quants import Unpacked

# The widest nibble group the integer kernels take: on AVX2 without VNNI they keep nibbles' pair sums in 16
# bits (kernels/qdot.nibble_pairs), a row's eight sums of at most 2 * 15 * 127 a group added in one 16-bit
# lane before they are widened. Every GGUF type's nibble group is 32 columns.
NIBBLE_GROUP_MAX = 32


def _interleave(values: np.ndarray, tiles: int, groups: int) -> np.ndarray:
    """[8T, G * w] row-ordered -> [T, G * w * 8]: per tile, group, and column, the 8 rows side by side."""
    width = values.shape[1] // groups
    if tiles == 0:  # a new empty array: an empty view would keep the whole row-ordered `values` alive
        return np.empty((0, groups * width * LANES), dtype=values.dtype)
    shaped = values[:tiles * LANES].reshape(tiles, LANES, groups, width)
    return shaped.transpose(0, 2, 3, 1).copy().reshape(tiles, groups * width * LANES)  # always a copy (see tiles == 0)


def _deinterleave(tiled: np.ndarray, groups: int) -> np.ndarray:
    """The inverse of `_interleave`: [T, G * w * 8] -> [8T, G * w]."""
    tiles = tiled.shape[0]
    shaped = tiled.reshape(tiles, groups, tiled.shape[1] // (groups * LANES), LANES)
    return np.ascontiguousarray(shaped.transpose(0, 3, 1, 2)).reshape(tiles * LANES, shaped.shape[1] * shaped.shape[2])


def to_tiles(u: Unpacked, tail_offsets_only: bool = False) -> tuple[Unpacked, Unpacked]:
    """(tiles, tail) of a row-ordered matrix: whole tiles of 8 rows interleaved, the rest row-ordered.
    `tail_offsets_only`: `u.offsets` holds the tail rows' offsets alone (the tiles' are folded, see
    QuantizedMatrix.from_unpacked); the tiles get none."""
    rows, groups = u.scales.shape
    tiles = rows // LANES
    whole = tiles * LANES

    def split(a: np.ndarray | None) -> tuple[np.ndarray | None, np.ndarray | None]:
        if a is None:
            return None, None
        if a is u.offsets and tail_offsets_only:
            return None, a.copy()
        # a copy even when empty: a view would keep the whole row-ordered array alive (a second copy of
        # every matrix, measured: 2.6 GB resident for a 578 MiB Q4_0 file)
        return _interleave(a, tiles, groups), a[whole:].copy()

    codes, tail_codes = split(u.codes)
    scales, tail_scales = split(u.scales)
    offsets, tail_offsets = split(u.offsets)
    return Unpacked(codes, scales, offsets, u.group), Unpacked(tail_codes, tail_scales, tail_offsets, u.group)


def to_dot_codes(codes: np.ndarray, groups: int) -> np.ndarray:
    """Tiled codes [T, G * w * 8] -> [T, G, w * 8] with each group's columns in quads: per quad of four
    columns, the eight rows' four bytes side by side ((g, j, r) -> (g, j // 4, r, j % 4)), so that one
    32-byte load feeds one integer dot product per row (kernels/qdot.py). w = bytes a row of a group."""
    tiles, width = codes.shape[0], codes.shape[1] // (groups * LANES)
    shaped = codes.reshape(tiles, groups, width // 4, 4, LANES)
    return np.ascontiguousarray(shaped.transpose(0, 1, 2, 4, 3)).reshape(tiles, groups, width * LANES)


def from_dot_codes(dot: np.ndarray, groups: int, bias: int = 0) -> np.ndarray:
    """Tiled codes (the float kernels' layout) of dot-layout codes: the inverse of `to_dot_codes`
    ([T, G, w * 8] quads -> [T, G * w * 8]), or of `to_packed_codes` where `dot` has four axes."""
    if dot.ndim == 4:
        return _from_packed(dot, groups, bias)
    tiles, width = dot.shape[0], dot.shape[2] // LANES
    shaped = dot.reshape(tiles, groups, width // 4, LANES, 4)
    return np.ascontiguousarray(shaped.transpose(0, 1, 2, 4, 3)).reshape(tiles, groups * width * LANES)


def gather_dot_codes(dot: np.ndarray, index: np.ndarray, bias: int = 0) -> np.ndarray:
    """Row-ordered codes [len(index), G * w] of rows `index` (all in whole tiles) of dot-layout codes
    [T, G, w * 8]: an embedding lookup reads the integer kernels' layout as it is, no second copy. 5- and
    6-bit codes (four axes) are widened a tile at a time, the tiles the rows sit in only, then the rows taken."""
    if dot.ndim == 4:  # each tile widened once, however many of its rows are taken (a band takes all eight)
        groups, width = dot.shape[1], _packed_group(dot)
        needed, where = np.unique(index // LANES, return_inverse=True)
        tiled = _from_packed(dot[needed], groups, bias).reshape(len(needed), groups, width, LANES)
        picked = tiled[where.reshape(-1), :, :, index % LANES]
        return np.ascontiguousarray(picked).reshape(len(index), groups * width)
    tiles, groups, width = dot.shape[0], dot.shape[1], dot.shape[2] // LANES
    shaped = dot.reshape(tiles, groups, width // 4, LANES, 4)
    return np.ascontiguousarray(shaped[index // LANES, :, :, index % LANES, :]).reshape(len(index), groups * width)


# Types whose codes are 5-bit (0..31 once Q5_0's bias 16 is added): the integer kernels read them as a nibble
# and a bit (`to_dot_codes5`), 5 bits a weight as in the file, where int8 codes were 8 (SmolLM2's Q4_K_M file
# is mostly Q5_0: its 576 columns are no multiple of 256, so llama.cpp falls back from Q4_K).
# Q6_K's 6-bit codes (-32..31, 0..63 once layout.SMALL_BIAS is added) likewise as a nibble and a crumb
# (`to_dot_codes6`): Q4_K_M files keep their embeddings and half their v and down matrices in Q6_K.
PACKED_TYPES = {"Q5_0": 5, "Q5_1": 5, "Q5_K": 5, "Q6_K": 6}
FIVE_BIT_GROUP = 32  # columns a group: 16 nibble bytes a row (kernels/qdot.py takes four 32-byte loads a group)
SIX_BIT_GROUP = 16  # columns a group: 8 nibble bytes a row (two 32-byte loads a group)
PACKED_GROUPS = {5: FIVE_BIT_GROUP, 6: SIX_BIT_GROUP}


def packed_bits(type_name: str, group: int) -> int:
    """The bits a code both layouts keep a matrix's codes in below a byte (`to_packed_codes`): 5 or 6, else 0."""
    bits = PACKED_TYPES.get(type_name, 0)
    return bits if bits and group == PACKED_GROUPS[bits] else 0


def to_packed_codes(codes: np.ndarray, groups: int, bits: int, bias: int) -> np.ndarray:
    """Tiled codes (int8 [T, G * group * 8]) packed `bits` bits each: `to_dot_codes5` or `to_dot_codes6`."""
    return to_dot_codes5(codes, groups, bias) if bits == 5 else to_dot_codes6(codes, groups, bias)


def _packed_group(dot: np.ndarray) -> int:
    """Columns a group of packed codes: int8 arrays are 6-bit ones (layout.CRUMB_PLANE), uint8 5-bit."""
    return SIX_BIT_GROUP if dot.dtype == np.int8 else FIVE_BIT_GROUP


def _from_packed(dot: np.ndarray, groups: int, bias: int) -> np.ndarray:
    """Tiled int8 codes [T, G * group * 8] of packed ones (`to_packed_codes` inverted, bias taken off)."""
    return _from_dot_codes6(dot, groups, bias) if dot.dtype == np.int8 else _from_dot_codes5(dot, groups, bias)


def _in_bands(codes: np.ndarray, out: np.ndarray, pack) -> np.ndarray:
    """out[t0:t1] = pack(codes[t0:t1]) a band of tiles of ~256 K codes at a time: whole, the temporaries for
    an embedding table's 28 M codes were ~150 MiB on top of a load's peak."""
    band = max(1, (1 << 18) // max(codes.shape[1], 1))
    for t0 in range(0, codes.shape[0], band):
        out[t0:t0 + band] = pack(codes[t0:t0 + band])
    return out


def _biased(codes: np.ndarray, bias: int, bits: int) -> np.ndarray:
    """code + bias as uint8, refused unless every one lies in 0..2**bits - 1."""
    u = codes.astype(np.int16) + bias
    if u.size and (u.min() < 0 or u.max() >= 1 << bits):
        raise ValueError(f"{bits}-bit codes (plus bias {bias}) must lie in 0..{(1 << bits) - 1}")
    return u.astype(np.uint8)


def to_dot_codes5(codes: np.ndarray, groups: int, bias: int) -> np.ndarray:
    """Tiled 5-bit codes (int8 [T, G * 32 * 8], code + bias in 0..31) as the integer kernels read them:
    [T, G, 5, 32] uint8 per group, four planes of 32 bytes as `to_dot_codes` makes of Q4's nibbles (load q:
    byte (r, c) = row r's column 4q + c in the low nibble, column 16 + 4q + c in the high), then one plane of
    the fifth bits: 8 bytes per load q, byte r = the bits of row r's eight codes of that load (bit c: column
    4q + c, bit 4 + c: column 16 + 4q + c), so one 8-byte load, a byte shuffle and two masks give a load's
    bits in the bytes beside its nibbles (kernels/qdot.py). Made a band of tiles at a time (`_in_bands`)."""
    out = np.empty((codes.shape[0], groups, BIT_PLANE + 1, 32), dtype=np.uint8)
    return _in_bands(codes, out, lambda band: _five_bit_planes(band, groups, bias))


def _five_bit_planes(codes: np.ndarray, groups: int, bias: int) -> np.ndarray:
    """`to_dot_codes5` of a band of tiles."""
    tiles = codes.shape[0]
    u = _biased(codes, bias, 5).reshape(tiles, groups, FIVE_BIT_GROUP, LANES)
    half = FIVE_BIT_GROUP // 2
    nibbles = (u[:, :, :half] & 0x0F) | ((u[:, :, half:] & 0x0F) << 4)  # [T, G, 16, 8]: byte j, row r
    planes = to_dot_codes(nibbles.reshape(tiles, groups * FIVE_BIT_GROUP // 2 * LANES), groups)
    planes = planes.reshape(tiles, groups, BIT_PLANE, 32)
    high = (u >> 4).reshape(tiles, groups, 2, BIT_PLANE, 4, LANES)  # (half, load q, column c, row r)
    weights = (np.uint8(1) << np.arange(8, dtype=np.uint8)).reshape(1, 1, 2, 1, 4, 1)
    bits = (high * weights).sum(axis=(2, 4), dtype=np.uint8)  # [T, G, q, r]
    return np.ascontiguousarray(np.concatenate([planes, bits.reshape(tiles, groups, 1, 32)], axis=2))


def _from_dot_codes5(dot: np.ndarray, groups: int, bias: int) -> np.ndarray:
    """The inverse of `to_dot_codes5`: [T, G, 5, 32] -> tiled int8 codes [T, G * 32 * 8] (code, bias taken off)."""
    tiles = dot.shape[0]
    nibbles = from_dot_codes(np.ascontiguousarray(dot[:, :, :BIT_PLANE]).reshape(tiles, groups, BIT_PLANE * 32),
                             groups)
    nibbles = nibbles.reshape(tiles, groups, FIVE_BIT_GROUP // 2, LANES)
    low = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=2)  # [T, G, 32, 8]
    bits = dot[:, :, BIT_PLANE].reshape(tiles, groups, 1, BIT_PLANE, 1, LANES)
    shifts = np.arange(8, dtype=np.uint8).reshape(1, 1, 2, 1, 4, 1)
    high = ((bits >> shifts) & 1).reshape(tiles, groups, FIVE_BIT_GROUP, LANES)
    u = low | (high << 4)
    return (u.astype(np.int16) - bias).astype(np.int8).reshape(tiles, groups * FIVE_BIT_GROUP * LANES)


def to_dot_codes6(codes: np.ndarray, groups: int, bias: int) -> np.ndarray:
    """Tiled 6-bit codes (int8 [T, G * 16 * 8], code + bias in 0..63: Q6_K's with layout.SMALL_BIAS) as the
    integer kernels read them: [T, G, 3, 32] per group, two planes of 32 bytes as `to_dot_codes` makes of
    nibbles in groups of 16 (load p: byte 4r + c = row r's column 4p + c in the low nibble, 8 + 4p + c in the
    high), then one plane of crumbs: byte 4r + c holds the two high bits of column 4p + c at bits 4p, 4p + 1
    and of column 8 + 4p + c at 4p + 2, 4p + 3, so a load's high bits are the crumb plane shifted by a
    constant and masked, the same for every byte (kernels/qdot.py): 6 bits a weight, as in the file. int8,
    the bytes of code + bias: the dtype tells the kernels 6-bit codes from 5-bit ones (layout.CRUMB_PLANE)."""
    out = np.empty((codes.shape[0], groups, CRUMB_PLANE + 1, 32), dtype=np.uint8)
    return _in_bands(codes, out, lambda band: _six_bit_planes(band, groups, bias)).view(np.int8)


# the crumb plane's shift for (half h, load p): column 8h + 4p + c's two high bits sit at bit 4p + 2h
_CRUMB_SHIFTS = (4 * np.arange(CRUMB_PLANE, dtype=np.uint8)[None, :]
                 + 2 * np.arange(2, dtype=np.uint8)[:, None]).reshape(1, 1, 2, CRUMB_PLANE, 1, 1)


def _six_bit_planes(codes: np.ndarray, groups: int, bias: int) -> np.ndarray:
    """`to_dot_codes6` of a band of tiles (uint8)."""
    tiles = codes.shape[0]
    u = _biased(codes, bias, 6).reshape(tiles, groups, SIX_BIT_GROUP, LANES)  # (t, g, column, row)
    half = SIX_BIT_GROUP // 2
    nibbles = (u[:, :, :half] & 0x0F) | ((u[:, :, half:] & 0x0F) << 4)  # [T, G, 8, 8]: byte j, row r
    planes = to_dot_codes(nibbles.reshape(tiles, groups * half * LANES), groups).reshape(tiles, groups, CRUMB_PLANE, 32)
    high = (u >> 4).reshape(tiles, groups, 2, CRUMB_PLANE, 4, LANES)  # (half, load p, column c, row r)
    crumbs = (high << _CRUMB_SHIFTS).sum(axis=(2, 3), dtype=np.uint8)  # [T, G, c, r]: disjoint bits, an OR
    crumbs = crumbs.transpose(0, 1, 3, 2).reshape(tiles, groups, 1, 32)  # byte 4r + c
    return np.ascontiguousarray(np.concatenate([planes, crumbs], axis=2))


def _from_dot_codes6(dot: np.ndarray, groups: int, bias: int) -> np.ndarray:
    """The inverse of `to_dot_codes6`: [T, G, 3, 32] -> tiled int8 codes [T, G * 16 * 8] (code, bias taken off)."""
    tiles, u8 = dot.shape[0], dot.view(np.uint8)
    half = SIX_BIT_GROUP // 2
    nibbles = from_dot_codes(np.ascontiguousarray(u8[:, :, :CRUMB_PLANE]).reshape(tiles, groups, CRUMB_PLANE * 32),
                             groups).reshape(tiles, groups, half, LANES)
    low = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=2)  # [T, G, 16, 8]
    crumbs = u8[:, :, CRUMB_PLANE].reshape(tiles, groups, LANES, 4).transpose(0, 1, 3, 2)  # (t, g, c, r)
    high = (crumbs.reshape(tiles, groups, 1, 1, 4, LANES) >> _CRUMB_SHIFTS) & 3  # (t, g, h, p, c, r)
    u = low | (high.reshape(tiles, groups, SIX_BIT_GROUP, LANES) << 4)
    return (u.astype(np.int16) - bias).astype(np.int8).reshape(tiles, groups * SIX_BIT_GROUP * LANES)


def row_ordered(tiled: np.ndarray | None, tail: np.ndarray | None, groups: int) -> np.ndarray | None:
    """One array (codes, scales or offsets) of (tiles, tail) back in row order [N, ...]."""
    return None if tiled is None else np.concatenate([_deinterleave(tiled, groups), tail])


def from_tiles(tiles: Unpacked, tail: Unpacked) -> Unpacked:
    """The row-ordered matrix of (tiles, tail) (`to_tiles` inverted)."""
    groups = tail.scales.shape[1]
    return Unpacked(row_ordered(tiles.codes, tail.codes, groups), row_ordered(tiles.scales, tail.scales, groups),
                    row_ordered(tiles.offsets, tail.offsets, groups), tiles.group)


def gather_rows(tiles: Unpacked, tail: Unpacked, index: np.ndarray) -> Unpacked:
    """Rows `index` (integers, any order) row-ordered, read straight from the tiles: an embedding lookup
    costs the rows it takes, not a whole-matrix transpose."""
    index = np.asarray(index, dtype=np.int64).reshape(-1)
    groups = tail.scales.shape[1]
    whole = tiles.scales.shape[0] * LANES
    in_tiles = index < whole
    tile, lane, tail_row = index // LANES, index % LANES, np.maximum(index - whole, 0)

    def take(a: np.ndarray | None, b: np.ndarray | None) -> np.ndarray | None:
        if a is None:
            return None
        width = b.shape[1]
        out = np.empty((index.shape[0], width), dtype=a.dtype)
        shaped = a.reshape(a.shape[0], groups, width // groups, LANES)
        out[in_tiles] = shaped[tile[in_tiles], :, :, lane[in_tiles]].reshape(-1, width)
        out[~in_tiles] = b[tail_row[~in_tiles]]
        return out

    return Unpacked(take(tiles.codes, tail.codes), take(tiles.scales, tail.scales),
                    take(tiles.offsets, tail.offsets), tiles.group)


def factor_scales(values: np.ndarray, per: int) -> tuple[np.ndarray, np.ndarray] | None:
    """Tiled K-type scales (or offsets) [T, G * 8] float32 as (ints int8 [T, G * 8], base float32
    [T, G / per * 8]) with base * ints == values exactly in float32, one base per super-block of `per`
    groups and row; None where no such pair exists. Why: a K type's scale is the file's float16 d times
    a small integer sub-block scale (d * sc, exact in float32, rarely in float16), so keeping the integer
    and one float per 256 weights costs 1 byte a group instead of 4, and the kernel's product
    base * float(int) rebuilds the same float32 scale bit for bit. The pair is found without the file's
    d: base = the greatest common divisor of the super-block's odd mantissas times its lowest power of
    two, so every int is the sub-block scale over a common factor, no larger than it."""
    tiles, width = values.shape
    if width % (per * LANES) or tiles == 0:
        return None
    v = values.astype(np.float32).reshape(tiles, width // (per * LANES), per, LANES)
    mantissa, exponent = np.frexp(v.astype(np.float64))
    whole = (mantissa * 2.0 ** 24).astype(np.int64)  # exact: a float32's significand has 24 bits
    power = exponent.astype(np.int64) - 24
    low = np.where(whole != 0, whole & -whole, 1)  # the lowest set bit: strip the trailing zeros
    shift = np.log2(low).astype(np.int64)
    odd, power = whole >> shift, power + shift
    nonzero = whole != 0
    common = np.gcd.reduce(np.abs(odd), axis=2, keepdims=True)
    lowest = np.where(nonzero, power, np.iinfo(np.int64).max).min(axis=2, keepdims=True)
    lowest = np.where(common == 0, 0, lowest)
    base = np.ldexp(common.astype(np.float64), lowest)
    steps = np.where(nonzero, power - lowest, 0)
    if steps.max(initial=0) > 7:
        return None
    ints = np.where(nonzero, (odd // np.maximum(common, 1)) << steps, 0)
    # int8 holds -128 but not 128: a super-block whose ints reach 128 (a negative d times sc = -128) flips
    # the sign of its base
    flip = (ints.max(axis=2, keepdims=True) > 127) & (ints.min(axis=2, keepdims=True) >= -127)
    ints, base = np.where(flip, -ints, ints), np.where(flip, -base, base)
    if ints.max(initial=0) > 127 or ints.min(initial=0) < -128 or np.any(np.abs(base) > np.finfo(np.float32).max):
        return None
    base32 = base.astype(np.float32)
    ints8 = ints.astype(np.int8)
    if not np.array_equal(base32 * ints8.astype(np.float32), v):
        return None
    return ints8.reshape(tiles, width), np.ascontiguousarray(base32[:, :, 0, :]).reshape(tiles, -1)


def expand_scales(ints: np.ndarray, base: np.ndarray) -> np.ndarray:
    """`factor_scales` undone: [T, G * 8] float32 = base (per super-block) * ints."""
    tiles, width = ints.shape
    blocks = base.shape[1] // LANES
    shaped = ints.reshape(tiles, blocks, width // (blocks * LANES), LANES).astype(np.float32)
    return (shaped * base.reshape(tiles, blocks, 1, LANES)).reshape(tiles, width)
