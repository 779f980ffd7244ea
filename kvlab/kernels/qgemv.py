"""Matrix-vector and small-batch products over quantized weights in the kernels' tiled layout.

A weight matrix arrives as tiles of eight output rows interleaved (kvlab/model/qtiles.py) and a row-ordered
tail of N % 8 rows. Per tile, `qsimd.tile_product_R` runs rows of x four at a time (then 3, 2, 1) with the
eight output rows in the lanes of a register: codes widened in registers, one FMA per column and row of x,
per group one `scale * dot (+ offset * sum_g x)` on the eight lanes. A tile's codes (K bytes per row, a
few KiB) stay in L1 while the blocks of four rows of x reuse them. The tail rows go through a plain
per-row loop (`tail_rows`). Tiles go over the threads.

The group sums of x (for offsets: Q4_0's -8 scale, Q4_1/Q5_1's min, the K types' mins) are computed once
per product, not per weight row. The NumPy twin is `ggml_quants.dequantize` followed by `x @ W.T`.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from kvlab.kernels.compile_names import renamed
from kvlab.kernels.qdot import PAIRS, WIDE, tile_dot_1, tile_dot_2, tile_dot_3, tile_dot_4, tile_dot_8, tile_dot_8x2
from kvlab.kernels.qsimd import tile_product_1, tile_product_2, tile_product_3, tile_product_4

FASTMATH = {"reassoc", "contract"}
NO_OFFSETS = np.zeros((0, 0), dtype=np.float32)


@njit(cache=True, inline="always")
def product_tile(x, xsum, codes, scales, offsets, base_scales, base_offsets, group, out, t):
    """out[:, 8t:8t+8] = x @ (tile t's eight rows).T for every row of x (scales and offsets as qsimd takes
    them: float32, or factored int8 with their bases)."""
    rows = x.shape[0]
    m = 0
    while m + 4 <= rows:
        tile_product_4(x, m, xsum, codes, scales, offsets, base_scales, base_offsets, group, t, out)
        m += 4
    left = rows - m
    if left == 1:
        tile_product_1(x, m, xsum, codes, scales, offsets, base_scales, base_offsets, group, t, out)
    elif left == 2:
        tile_product_2(x, m, xsum, codes, scales, offsets, base_scales, base_offsets, group, t, out)
    elif left == 3:
        tile_product_3(x, m, xsum, codes, scales, offsets, base_scales, base_offsets, group, t, out)


@njit(fastmath=FASTMATH, cache=True, inline="always")
def _code(codes, n, k, group, nibbles):
    """Code of weight k in row n of row-ordered codes (int8, or nibbles: byte j of a group of 32 holds
    weights j (low) and j + 16 (high))."""
    if nibbles:
        half = group // 2
        g, j = k // group, k % group
        byte = np.int32(codes[n, g * half + j % half])
        return np.float32(byte & 15) if j < half else np.float32(byte >> 4)
    return np.float32(codes[n, k])


# No fast-math: numba links a kernel's code into every caller and optimises it again there, and with
# `reassoc`/`contract` LLVM was free to sum or fuse a tail row's steps differently in each copy (seen: a
# cold run's stacked q/k/v tail 1 ulp from the same matrix's product alone). Strict IEEE order gives every
# copy one result; the tail is fewer than eight rows a matrix, so its speed does not show. Inlined, it takes
# its caller's flags: `_qmatmul` and `dot_product` state fastmath=False, or a fast-math caller that compiled
# them first would have given them its own (tests/test_kernel_flags.py).
@njit(cache=True, inline="always")
def tail_rows(x, xsum, codes, scales, offsets, group, out, n0, dx=None):
    """out[:, n0 + i] for the row-ordered tail rows i (fewer than eight): a plain loop, it is small.
    With `dx` (the integer kernels' rounded rows: x int8, dx their scales, xsum = dx * sum(q)) each group's
    sum of code * q is an exact integer in float32 (below 2^24), then scaled by scale * dx."""
    has_offsets = offsets.shape[0] > 0
    nibbles = 2 * codes.shape[1] == scales.shape[1] * group  # two codes a byte (numba cannot compare dtypes)
    for i in range(scales.shape[0]):
        for m in range(x.shape[0]):
            total = np.float32(0)
            for g in range(scales.shape[1]):
                dot = np.float32(0)
                for j in range(group):
                    dot += np.float32(x[m, g * group + j]) * _code(codes, i, g * group + j, group, nibbles)
                scale = scales[i, g]
                if dx is not None:
                    scale = scale * dx[m, g]
                total += scale * dot
                if has_offsets:
                    total += offsets[i, g] * xsum[m, g]
            out[m, n0 + i] = total


@njit(cache=True, inline="always")
def group_sums_into(x, group, xsum):
    """xsum[m, g] = sum of x[m, g*group:(g+1)*group] (what an offset multiplies)."""
    for m in range(x.shape[0]):
        for g in range(xsum.shape[1]):
            total = np.float32(0)
            for j in range(group):
                total += x[m, g * group + j]
            xsum[m, g] = total


@njit(fastmath=False, parallel=True, cache=True)
def _qmatmul(x, xsum, t_xsum, codes, scales, offsets, t_codes, t_scales, t_offsets, group, base_scales, base_offsets,
             out):
    """out [M, N] = x @ W.T for W as (tiles, tail); tiles over the threads, the tail on the last index. The
    tiles' offsets multiply `xsum`, the tail's `t_xsum` (they differ by a folded factor: `kernel_args`)."""
    tiles = codes.shape[0]
    for t in prange(tiles + 1):
        if t < tiles:
            product_tile(x, xsum, codes, scales, offsets, base_scales, base_offsets, group, out, t)
        else:
            tail_rows(x, t_xsum, t_codes, t_scales, t_offsets, group, out, tiles * 8)


# --- activations rounded to int8 (model/act_quant.py's mode "q8"): integer dot products (kernels/qdot.py) ---
ABS_BITS = np.int32(0x7FFFFFFF)
INF_BITS = np.int32(0x7F800000)


@njit(cache=True, inline="always")
def round_row(x, bits, m, group, bias, xq, dx, qbias, fsum):
    """Row m of x [M, K] rounded per group as model/act_quant.round_activations does (the same float32
    steps): xq int8 [M, K], dx [M, G] the scales, qbias int32 [M, G] = -bias * the sums of xq (what
    takes the codes' bias off a group's integer dot, by an add: kernels/qdot.py), fsum = dx * the sums;
    `bits` is x's float32 bits (int32).
    A group's largest magnitude is found on the float32 bits (sign cleared, a non-negative float orders
    as its bits do, and inf and NaN above every finite value): an integer max the loop vectorises,
    which tells a non-finite group apart in the same pass (it rounds to zero with scale NaN)."""
    for g in range(dx.shape[1]):
        k0 = g * group
        top = np.int32(0)
        for j in range(group):
            top = max(top, bits[m, k0 + j] & ABS_BITS)
        total = np.int32(0)
        if top >= INF_BITS:  # inf or NaN in the group
            for j in range(group):
                xq[m, k0 + j] = 0
            d = np.float32(np.nan)
        else:
            d = np.int32(top).view(np.float32) / np.float32(127)
            inv = np.float32(0)
            if d > 0:
                inv = np.float32(1) / d
            if not np.isfinite(inv):  # d underflowed: the group rounds to zero
                inv = np.float32(0)
                d = np.float32(0)
            for j in range(group):
                q = min(max(np.rint(x[m, k0 + j] * inv), np.float32(-127)), np.float32(127))
                xq[m, k0 + j] = np.int8(q)
                total += np.int32(q)
        dx[m, g] = d
        qbias[m, g] = -bias * total
        fsum[m, g] = d * np.float32(total)


def _round_rows_into(x, group, bias, xq, dx, qbias, fsum):
    """Every row of x [M, K] float32 through `round_row`; rows are independent, so the parallel
    compile (rows over the threads) gives the serial one's bits."""
    xc = np.ascontiguousarray(x)
    bits = xc.view(np.int32)
    for m in prange(xc.shape[0]):
        round_row(xc, bits, m, group, bias, xq, dx, qbias, fsum)


# A decode step's row or two stay on the calling thread (a parallel region costs more than they do); a
# batch's or a prefill's rows go over the threads: at 16 rows of SmolLM2's down input the serial rounding
# was a quarter of the product's time on two threads (18 of 78 us).
round_rows_into = njit(fastmath=False, cache=True, error_model="numpy")(_round_rows_into)
_round_rows_parallel = njit(fastmath=False, parallel=True, cache=True, error_model="numpy")(
    renamed(_round_rows_into, "_round_rows_parallel"))
ROUND_PARALLEL_ROWS = 4


@njit(fastmath=False, cache=True)
def round_rows(x, group, bias):
    """(xq, dx, qbias, fsum) of `round_row` for every row of x [M, K] float32."""
    rows, groups = x.shape[0], x.shape[1] // group
    xq = np.empty(x.shape, dtype=np.int8)
    dx = np.empty((rows, groups), dtype=np.float32)
    qbias = np.empty((rows, groups), dtype=np.int32)
    fsum = np.empty((rows, groups), dtype=np.float32)
    if rows >= ROUND_PARALLEL_ROWS:
        _round_rows_parallel(x, group, np.int32(bias), xq, dx, qbias, fsum)
    else:
        round_rows_into(x, group, np.int32(bias), xq, dx, qbias, fsum)
    return xq, dx, qbias, fsum


@njit(cache=True, inline="always")
def dot_tile(xq, dx, qbias, fsum, codes, scales, offsets, base_scales, base_offsets, out, t, m):
    """out[m:, 8t:8t+8] = the rounded rows m.. of x @ (tile t's eight rows).T, in integer dot products: rows
    of x eight at a time where the CPU has 32 vector registers (qdot.WIDE), then four, then what is left.
    Every block size computes a row the same way (batch-invariant: kernels/qdot.py)."""
    rows = xq.shape[0]
    if WIDE:
        while m + 8 <= rows:
            tile_dot_8(xq, m, dx, qbias, fsum, codes, scales, offsets, base_scales, base_offsets, t, out)
            m += 8
    while m + 4 <= rows:
        tile_dot_4(xq, m, dx, qbias, fsum, codes, scales, offsets, base_scales, base_offsets, t, out)
        m += 4
    left = rows - m
    if left == 1:
        tile_dot_1(xq, m, dx, qbias, fsum, codes, scales, offsets, base_scales, base_offsets, t, out)
    elif left == 2:
        tile_dot_2(xq, m, dx, qbias, fsum, codes, scales, offsets, base_scales, base_offsets, t, out)
    elif left == 3:
        tile_dot_3(xq, m, dx, qbias, fsum, codes, scales, offsets, base_scales, base_offsets, t, out)


@njit(cache=True, inline="always")
def dot_tiles(xq, dx, qbias, fsum, codes, scales, offsets, base_scales, base_offsets, out, t, n):
    """out[:, 8t:8t + 8n] for tiles t.. t+n-1 (n = 1, or 2: a pair in zmm registers eight rows of x at a
    time, qdot.PAIRS; the rows left over tile by tile). A lane's arithmetic is the same either way."""
    m = 0
    while n == 2 and m + 8 <= xq.shape[0]:
        tile_dot_8x2(xq, m, dx, qbias, fsum, codes, scales, offsets, base_scales, base_offsets, t, out)
        m += 8
    for tile in range(t, t + n):  # one inlined copy of dot_tile (each copy is compile time)
        dot_tile(xq, dx, qbias, fsum, codes, scales, offsets, base_scales, base_offsets, out, tile, m)


# Tile pairs (qdot.PAIRS) from this many rows of x: then a pair's codes are read from L1 for a second block
# of eight rows and the products are bound by instructions, which pairs cut (a batch-16 step 0.74-0.86x the
# time over three A/B runs). At 8 rows each code is used once per step, the step streams the weights, and
# pairs measured 1.04x the time (two code streams per thread instead of one); at 1-4 rows, 1.2-1.4x.
PAIR_MIN_ROWS = 16


@njit(fastmath=False, parallel=True, cache=True)
def dot_product(x, w, out):
    """out = x @ W.T with x rounded to int8 per group (`round_rows`) and integer dot products, W as the
    tuple `dot_kernel_args` makes; tiles (pairs of tiles from PAIR_MIN_ROWS rows of x where qdot.PAIRS)
    over the threads, the tail on the last index."""
    xq, dx, qbias, fsum = round_rows(x, w[6], w[7])
    tiles = w[0].shape[0]
    step = 2 if PAIRS and x.shape[0] >= PAIR_MIN_ROWS else 1
    units = (tiles + step - 1) // step
    for u in prange(units + 1):
        if u < units:
            t = u * step
            dot_tiles(xq, dx, qbias, fsum, w[0], w[1], w[2], w[8], w[9], out, t, min(step, tiles - t))
        else:
            tail_rows(xq, fsum, w[3], w[4], w[5], w[6], out, tiles * 8, dx)


def dot_kernel_args(layout: tuple, tail) -> tuple:
    """(codes, scales, offsets, tail codes, tail scales, tail offsets, group, bias, base scales, base
    offsets, 0): a matrix as the integer kernels take it, from its dot layout (QuantizedMatrix.dot_layout:
    codes, scales, offsets, bias, base scales, base offsets) and the row-ordered tail (read by `tail_rows`
    as the float kernels read it). The eleventh field marks the layout: `kernel_args` gives ten, and the
    fused layer kernels pick the integer or the float product by the tuple's length when numba compiles
    them (kernels/qdecode_layer.py; 5-bit codes are the same array in both layouts)."""
    codes, scales, offsets, bias, base_scales, base_offsets = layout
    return (codes, scales, offsets, tail.codes, tail.scales, NO_OFFSETS if tail.offsets is None else tail.offsets,
            tail.group, bias, base_scales, base_offsets, 0)


def qmatmul_dot(x: np.ndarray, layout: tuple, tail) -> np.ndarray:
    """x [M, K] float32 rounded per group to int8, @ W.T in integer dot products (W: see dot_kernel_args)."""
    out = np.empty((x.shape[0], layout[0].shape[0] * 8 + tail.scales.shape[0]), dtype=np.float32)
    dot_product(x, dot_kernel_args(layout, tail), out)
    return out


def group_sums(x: np.ndarray, group: int) -> np.ndarray:
    """[M, K] -> [M, K / group]: the sums of x an offset multiplies (float32)."""
    return np.ascontiguousarray(x.reshape(x.shape[0], -1, group).sum(axis=-1, dtype=x.dtype))


def tile_offsets(tiles) -> tuple[np.ndarray, np.float32]:
    """(offsets, factor) of tiles as the float kernels read them (see `kernel_args`)."""
    if tiles.offsets is None and getattr(tiles, "offset_scale", None) is not None:
        return tiles.scales, np.float32(tiles.offset_scale)
    return (NO_OFFSETS if tiles.offsets is None else tiles.offsets), np.float32(1)


def kernel_args(tiles, tail) -> tuple:
    """(codes, scales, offsets, tail codes, tail scales, tail offsets, group, factor, base scales, base
    offsets) as the kernels take them: absent offsets as an empty array; offsets folded into the scales
    (Unpacked.offset_scale: Q4_0's -8 * scale) as the scales themselves, with the factor that multiplies the
    group sums of x they meet (1 otherwise); a K type's factored scales and offsets (int8) with their
    float32 bases, which have no columns otherwise. fma(scale, -8 * sum, acc) and fma(-8 * scale, sum, acc)
    round the same exact product (a power of two moves no bit): the same result as stored offsets, without
    the array."""
    offsets, factor = tile_offsets(tiles)
    return (tiles.codes, tiles.scales, offsets, tail.codes, tail.scales,
            NO_OFFSETS if tail.offsets is None else tail.offsets, tiles.group, factor,
            NO_OFFSETS if tiles.base_scales is None else tiles.base_scales,
            NO_OFFSETS if tiles.base_offsets is None else tiles.base_offsets)


def qmatmul(x: np.ndarray, tiles, tail) -> np.ndarray:
    """x [M, K] (float32, C-contiguous) @ W.T for W as tiles + tail (model/qtiles.py); [M, N] float32."""
    args = kernel_args(tiles, tail)
    rows = tiles.scales.shape[0] * 8 + tail.scales.shape[0]
    out = np.empty((x.shape[0], rows), dtype=np.float32)
    xsum = group_sums(x, tiles.group) if args[2].shape[0] or args[5].shape[0] else NO_OFFSETS
    t_xsum = xsum * args[7] if args[7] != 1 and args[2].shape[0] else xsum
    _qmatmul(x, t_xsum, xsum, *args[:7], args[8], args[9], out)
    return out


@njit(cache=True, inline="always")
def _lane_values(scales, offsets, base_scales, base_offsets, factor, t, g, block, lane_scale, lane_offset):
    """Group g's eight scales and offsets (times factor) of tile t as float32 (a K type's factored ones:
    int8 times a float32 base per super-block of `block` groups)."""
    for r in range(8):
        s = np.float32(scales[t, g * 8 + r])
        if base_scales.shape[1]:
            s = base_scales[t, g // block * 8 + r] * s
        lane_scale[r] = s
        if offsets.shape[0] > 0:
            o = np.float32(offsets[t, g * 8 + r])
            if base_offsets.shape[1]:
                o = base_offsets[t, g // block * 8 + r] * o
            lane_offset[r] = o * factor


@njit(cache=True, inline="always")
def _byte_columns(codes, t, g, group, nibbles, base, lane_scale, lane_offset, has_offsets, out):
    """Group g of tile t as values, int8 codes (a column's eight rows in 8 bytes) or nibbles (byte j: weight j
    low, j + group / 2 high): out[k, base + r] for the group's columns k."""
    per = group // 2 if nibbles else group
    for j in range(per):
        c0 = (g * per + j) * 8
        k = g * group + j
        for r in range(8):
            s = lane_scale[r]
            o = lane_offset[r]
            if nibbles:
                byte = np.int32(codes[t, c0 + r])
                low = np.float32(byte & 15) * s
                high = np.float32(byte >> 4) * s
                if has_offsets:
                    low += o
                    high += o
                out[k, base + r] = low
                out[k + per, base + r] = high
            else:
                value = np.float32(codes[t, c0 + r]) * s
                if has_offsets:
                    value += o
                out[k, base + r] = value


@njit(cache=True, inline="always")
def _packed_columns(codes, t, g, base, lane_scale, lane_offset, has_offsets, out):
    """Group g of tile t as values, 5-bit codes (uint8 [T, G, 5, 32], qtiles.to_dot_codes5: groups of 32) or
    6-bit ones (int8 [T, G, 3, 32], to_dot_codes6: groups of 16, code + 32): load q's byte 4r + c holds row
    r's columns 4q + c (low nibble) and half + 4q + c (high); the fifth bits' byte 8q + r holds theirs at
    bits c and 4 + c, the crumbs' byte 4r + c at bits 4q and 4q + 2. The eight rows' values of a column land
    in adjacent floats. Q5_0's codes are code + 16 with the offset -16 * scale folded (factor -16): scale * u
    and 16 * scale are exact in float32, so their sum is (u - 16) * scale exactly, as
    ggml_quants.dequantize computes it; a 6-bit code's 32 is taken off before the product."""
    six = codes.shape[2] == 3
    loads, half, bias = (2, 8, 32) if six else (4, 16, 0)
    for q in range(loads):
        for c in range(4):
            k = g * 2 * half + 4 * q + c
            for r in range(8):
                byte = np.int32(codes[t, g, q, 4 * r + c]) & 255
                if six:
                    crumb = np.int32(codes[t, g, 2, 4 * r + c]) & 255
                    low_bit, high_bit = (crumb >> (4 * q)) & 3, (crumb >> (4 * q + 2)) & 3
                else:
                    bits = np.int32(codes[t, g, 4, 8 * q + r])
                    low_bit, high_bit = (bits >> c) & 1, (bits >> (4 + c)) & 1
                low = np.float32(((byte & 15) | (low_bit << 4)) - bias) * lane_scale[r]
                high = np.float32(((byte >> 4) | (high_bit << 4)) - bias) * lane_scale[r]
                if has_offsets:
                    low += lane_offset[r]
                    high += lane_offset[r]
                out[k, base + r] = low
                out[k + half, base + r] = high


@njit(fastmath=False, parallel=True, cache=True)
def _dequantize_tiles_t(codes, scales, offsets, base_scales, base_offsets, factor, group, t0, t1, out):
    """out[k, 8(t - t0) + r] = scale * code + offset * factor for tiles t0..t1-1 (factor 1, or a folded
    offset's power of two: exact): the band transposed, so a tile's eight interleaved codes of one column
    land in eight adjacent floats (the r loop vectorises: loads and stores both contiguous). IEEE float32
    as ggml_quants.dequantize computes it (multiply, then add; no contraction: the same bits). Codes of
    four axes are packed 5- or 6-bit ones (`_packed_columns`; numba folds `ndim` before typing)."""
    groups = scales.shape[1] // 8
    nibbles = 2 * codes.shape[1] == groups * group * 8
    has_offsets = offsets.shape[0] > 0
    block = groups // max(base_scales.shape[1] // 8, 1)
    for t in prange(t0, t1):
        base = (t - t0) * 8
        lane_scale = np.empty(8, dtype=np.float32)
        lane_offset = np.zeros(8, dtype=np.float32)
        for g in range(groups):
            _lane_values(scales, offsets, base_scales, base_offsets, factor, t, g, block, lane_scale, lane_offset)
            if codes.ndim == 4:
                _packed_columns(codes, t, g, base, lane_scale, lane_offset, has_offsets, out)
            else:
                _byte_columns(codes, t, g, group, nibbles, base, lane_scale, lane_offset, has_offsets, out)


def dequantize_tiles_t(tiles, t0: int, t1: int, out: np.ndarray) -> None:
    """Tiles t0..t1-1 of a tiled matrix (model/qtiles.py) as float32 columns: out [K, 8 (t1 - t0)] is the
    transposed band of rows, a prefill's weights dequantized where BLAS reads them (x @ out)."""
    offsets, factor = tile_offsets(tiles)
    bases = (NO_OFFSETS if tiles.base_scales is None else tiles.base_scales,
             NO_OFFSETS if tiles.base_offsets is None else tiles.base_offsets)
    _dequantize_tiles_t(tiles.codes, tiles.scales, offsets, *bases, factor, tiles.group, t0, t1, out)
