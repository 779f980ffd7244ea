"""Decode attention that reads the K/V cache where it lies: contiguous rows or paged blocks.

One new query per sequence attends to its cached keys and values. The cache may be float32, float16 or
bfloat16: elements are widened in registers as they are read (bits.py), never by upcasting the whole
cache per step. GQA stays compact (DESIGN invariant 3): the G query heads of a KV head are one work item,
so each key and value row is read once for the whole group.

Work is split over (sequence, KV head, span of keys) so that both cores have work at batch 1 with few
KV heads (split-K, "flash-decoding"): each span yields its own row max, exp-sum and unnormalised value
sum, and the spans are combined exactly, rescaled to the common max. The NumPy twins are
`decode_attention_reference` (contiguous; the model's `_decode_blocks` does the same on its NumPy path)
and `paged.paged_decode_attention_reference`.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from kvlab.kernels.bits import as_kernel_array, widen

FASTMATH = {"reassoc", "contract"}
SPAN = 64  # keys per work item: small enough that batch 1 with 3 KV heads still splits over two cores


@njit(fastmath=FASTMATH, cache=True, inline="always")
def _span(q, h, group, keys, values, lo, hi, zero, row_max, row_sum, acc):
    """Attend q's group of heads (rows h*group .. of q [H_q, d], pre-scaled) to keys[lo:hi] / values[lo:hi]
    ([T, d] each): write this span's per-head max, exp-sum and unnormalised value sum [group, d]."""
    d = q.shape[1]
    n = hi - lo
    scores = np.empty((group, n), dtype=q.dtype)
    for t in range(n):
        key = keys[lo + t]
        for g in range(group):
            qg = q[h * group + g]
            s = zero
            for i in range(d):
                s += qg[i] * widen(key[i])
            scores[g, t] = s
    for g in range(group):
        top = scores[g, 0]
        for t in range(1, n):
            top = max(top, scores[g, t])
        total = zero
        for t in range(n):
            p = np.exp(scores[g, t] - top)
            scores[g, t] = p
            total += p
        row_max[g] = top
        row_sum[g] = total
        for i in range(d):
            acc[g, i] = zero
    for t in range(n):
        value = values[lo + t]
        for g in range(group):
            p = scores[g, t]
            ag = acc[g]
            for i in range(d):
                ag[i] += p * widen(value[i])


@njit(fastmath=FASTMATH, cache=True, inline="always")
def _combine(row_max, row_sum, acc, out):
    """out [group, d] = sum_c acc[c] e^(max_c - M) / sum_c sum_c e^(max_c - M) over spans c (M: max of maxes)."""
    spans, group, d = acc.shape
    for g in range(group):
        top = row_max[0, g]
        for c in range(1, spans):
            top = max(top, row_max[c, g])
        total = row_sum[0, g] * 0
        for i in range(d):
            out[g, i] = total
        for c in range(spans):
            w = np.exp(row_max[c, g] - top)
            total += row_sum[c, g] * w
            for i in range(d):
                out[g, i] += acc[c, g, i] * w
        for i in range(d):
            out[g, i] /= total


@njit(parallel=True, fastmath=FASTMATH, cache=True)
def _decode_contiguous(q, keys, values, start, end, span, out, zero):
    batch, kv_heads = keys.shape[0], keys.shape[1]
    group, d = q.shape[1] // kv_heads, q.shape[2]
    spans = (end - start + span - 1) // span
    row_max = np.empty((batch, kv_heads, spans, group), dtype=q.dtype)
    row_sum = np.empty_like(row_max)
    acc = np.empty((batch, kv_heads, spans, group, d), dtype=q.dtype)
    for item in prange(batch * kv_heads * spans):
        b, rest = divmod(np.int64(item), kv_heads * spans)  # prange indices are unsigned: keep ints signed
        h, c = divmod(rest, spans)
        lo = start + c * span
        _span(q[b], h, group, keys[b, h], values[b, h], lo, min(lo + span, end), zero,
              row_max[b, h, c], row_sum[b, h, c], acc[b, h, c])
    for item in prange(batch * kv_heads):
        b, h = divmod(np.int64(item), kv_heads)
        _combine(row_max[b, h], row_sum[b, h], acc[b, h], out[b, h * group:(h + 1) * group])


def decode_attention(q: np.ndarray, keys: np.ndarray, values: np.ndarray, start: int, end: int,
                     scale: float | None = None) -> np.ndarray:
    """Attention of one query per row, q [B, H_q, d], to cached keys/values [B, H_kv, >=end, d] rows
    start..end-1 (any float dtype; read in place). Returns [B, H_q, d] in q's dtype."""
    if not 0 <= start < end <= keys.shape[2]:
        raise ValueError(f"key range [{start}, {end}) is empty or outside a cache of {keys.shape[2]} rows")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    q = np.ascontiguousarray(q * q.dtype.type(scale))
    out = np.empty_like(q)
    _decode_contiguous(q, as_kernel_array(keys), as_kernel_array(values), int(start), int(end), SPAN, out,
                       q.dtype.type(0))
    return out


def decode_attention_reference(q: np.ndarray, keys: np.ndarray, values: np.ndarray, start: int, end: int,
                               scale: float | None = None) -> np.ndarray:
    """The NumPy twin: softmax(q K^T * scale) V over rows start..end-1, GQA-grouped, K/V widened first."""
    batch, heads, d = q.shape
    kv_heads = keys.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    k = keys[:, :, start:end].astype(q.dtype)
    v = values[:, :, start:end].astype(q.dtype)
    q5 = q.reshape(batch, kv_heads, heads // kv_heads, d) * q.dtype.type(scale)
    scores = q5 @ k.swapaxes(-1, -2)  # [B, H_kv, G, T]
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    return (scores @ v).reshape(batch, heads, d)
