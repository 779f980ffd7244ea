"""Matrix-vector and small-batch products over quantized weights, read as codes, scales and offsets.

A weight row of a quantized matrix is groups of 16 or 32 integer codes with one scale (and offset) per
group (kvlab/model/ggml_quants.py). Per group and row of x the kernel forms the integer-coded dot product
sum_j x_j c_j in float32 and applies the group's scale once: sum_g (s_g sum_j x_j c_j + o_g sum_j x_j),
where the group sums of x (for offsets) are computed once per product, not once per weight row. That is
the dequantized product up to summation order: the codes are exact small integers and scale, offset are
the file's. Codes are widened in registers from int8 or from nibbles; rows of x go four at a time, so a
group's codes, read once, feed four accumulators (batched decode reuses each block across rows). Output
rows are split over the threads. The NumPy twin is `ggml_quants.dequantize` followed by `x @ W.T`.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from kvlab.kernels.bits import widen

FASTMATH = {"reassoc", "contract"}


@njit(fastmath=FASTMATH, cache=True, inline="always")
def _group_dot_int8(xg, cg, zero):
    acc = zero
    for j in range(cg.shape[0]):
        acc += xg[j] * np.float32(cg[j])
    return acc


@njit(fastmath=FASTMATH, cache=True, inline="always")
def _group_dot_nibbles(xg, cg, zero):
    """cg: 16 bytes, byte j = codes of weights j (low nibble) and j + 16 (high) of the group's 32."""
    half = cg.shape[0]
    lo, hi = xg[:half], xg[half:]
    acc = zero
    for j in range(half):
        byte = np.int32(cg[j])
        acc += lo[j] * np.float32(byte & 15) + hi[j] * np.float32(byte >> 4)
    return acc


def _column(x, xsum, codes, scales, offsets, group, out, zero, n, nibbles):
    rows = x.shape[0]
    groups = scales.shape[1]
    code_width = group // 2 if nibbles else group
    cn, sn = codes[n], scales[n]
    has_offsets = offsets.shape[0] > 0
    for b in range(0, rows - rows % 4, 4):
        x0, x1, x2, x3 = x[b], x[b + 1], x[b + 2], x[b + 3]
        a0, a1, a2, a3 = zero, zero, zero, zero
        for g in range(groups):
            lo = g * group
            cg = cn[g * code_width:(g + 1) * code_width]
            if nibbles:
                d0 = _group_dot_nibbles(x0[lo:lo + group], cg, zero)
                d1 = _group_dot_nibbles(x1[lo:lo + group], cg, zero)
                d2 = _group_dot_nibbles(x2[lo:lo + group], cg, zero)
                d3 = _group_dot_nibbles(x3[lo:lo + group], cg, zero)
            else:
                d0 = _group_dot_int8(x0[lo:lo + group], cg, zero)
                d1 = _group_dot_int8(x1[lo:lo + group], cg, zero)
                d2 = _group_dot_int8(x2[lo:lo + group], cg, zero)
                d3 = _group_dot_int8(x3[lo:lo + group], cg, zero)
            s = widen(sn[g])
            a0 += s * d0
            a1 += s * d1
            a2 += s * d2
            a3 += s * d3
            if has_offsets:
                o = widen(offsets[n, g])
                a0 += o * xsum[b, g]
                a1 += o * xsum[b + 1, g]
                a2 += o * xsum[b + 2, g]
                a3 += o * xsum[b + 3, g]
        out[b, n], out[b + 1, n], out[b + 2, n], out[b + 3, n] = a0, a1, a2, a3
    for m in range(rows - rows % 4, rows):
        xm = x[m]
        acc = zero
        for g in range(groups):
            lo = g * group
            cg = cn[g * code_width:(g + 1) * code_width]
            if nibbles:
                d = _group_dot_nibbles(xm[lo:lo + group], cg, zero)
            else:
                d = _group_dot_int8(xm[lo:lo + group], cg, zero)
            acc += widen(sn[g]) * d
            if has_offsets:
                acc += widen(offsets[n, g]) * xsum[m, g]
        out[m, n] = acc


qmatvec_column = njit(fastmath=FASTMATH, cache=True, inline="always")(_column)


@njit(parallel=True, fastmath=FASTMATH, cache=True)
def _qmatvec(x, xsum, codes, scales, offsets, group, out, zero, nibbles):
    """out[m, n] = sum_k x[m, k] * W[n, k] for W given as codes/scales/offsets: output rows over threads."""
    for n in prange(codes.shape[0]):
        qmatvec_column(x, xsum, codes, scales, offsets, group, out, zero, n, nibbles)


def group_sums(x: np.ndarray, group: int) -> np.ndarray:
    """[M, K] -> [M, K / group]: the sums of x an offset multiplies (float32, in x's summation)."""
    return np.ascontiguousarray(x.reshape(x.shape[0], -1, group).sum(axis=-1, dtype=x.dtype))


def qmatvec(x: np.ndarray, codes: np.ndarray, scales: np.ndarray, offsets: np.ndarray | None,
            group: int) -> np.ndarray:
    """x [M, K] (float32, C-contiguous) @ W.T for W [N, K] as codes/scales/offsets; [M, N] float32.

    scales/offsets float32 (float16 as int16 bits works too, slower: see model/ggml_quants.py)."""
    out = np.empty((x.shape[0], codes.shape[0]), dtype=x.dtype)
    nibbles = codes.dtype == np.uint8
    if offsets is None:
        xsum = np.zeros((x.shape[0], 0), dtype=x.dtype)
        offsets = np.zeros((0, 0), dtype=scales.dtype)
    else:
        xsum = group_sums(x, group)
    _qmatvec(x, xsum, codes, scales, offsets, group, out, x.dtype.type(0), nibbles)
    return out
