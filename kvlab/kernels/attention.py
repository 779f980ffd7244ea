"""Decode attention that reads the K/V cache where it lies: paged blocks, or contiguous rows.

One new query per sequence attends to its cached keys and values. The cache may be float32, float16 or
bfloat16: elements are widened in registers as they are read (bits.py), never by upcasting the whole
cache per step. GQA stays compact (DESIGN invariant 3): the G query heads of a KV head are one work item,
so each key and value row is read once for the whole group.

Both layouts are one kernel. The paged cache is `k_blocks[num_blocks, H_kv, block_size, d]` with a
`block_table` per sequence (key t of sequence s is row t % block_size of block block_table[s, t //
block_size]); a contiguous cache [B, H_kv, capacity, d] is the same thing with one block per sequence.

Work is split over (sequence, KV head, span of keys) so that both cores have work at batch 1 with few KV
heads (split-K, as flash-decoding does): each span yields its row max, exp-sum and unnormalised value sum,
and the spans are combined exactly, rescaled to the common max. The NumPy twins below gather, widen and
softmax in the plain way; tests/test_kernels.py holds each kernel to its twin.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from kvlab.kernels.bits import as_kernel_array, widen
from kvlab.kernels.fastexp import fast_exp

FASTMATH = {"reassoc", "contract"}
SPAN = 64  # keys per work item: batch 1 with 3 KV heads at 128 context still splits over both cores


@njit(fastmath=FASTMATH, cache=True, inline="always")
def _span(q, h, group, k_blocks, v_blocks, table, block_size, lo, hi, zero, row_max, row_sum, acc, scores):
    """Keys lo..hi-1 of one sequence (through its block `table`) against the group of query heads of KV
    head h (rows h*group.. of q [H_q, d], pre-scaled): this span's per-head max, exp-sum, and
    unnormalised value sum acc [group, d]. An empty span gives max -inf, sum 0, acc 0. `scores` [group,
    >= hi - lo] is scratch from the caller: an allocation inside a parallel loop serialised the threads
    (measured: 2 threads took as long as 1 at 4096 keys; with the scratch hoisted, 1.9x faster)."""
    d = q.shape[1]
    n = max(hi - lo, 0)
    # (block, row) of key lo, then stepped row by row: a division per key cost more than its dot products
    first_block, first_row = lo // block_size, lo % block_size
    block, row = first_block, first_row
    for t in range(n):
        key = k_blocks[table[block], h, row]
        for g in range(group):
            qg = q[h * group + g]
            s = zero
            for i in range(d):
                s += qg[i] * widen(key[i])
            scores[g, t] = s
        row += 1
        if row == block_size:
            block, row = block + 1, 0
    for g in range(group):
        seen = scores[g]
        top = seen[0] if n else zero
        for t in range(n):
            top = max(top, seen[t])
        total = zero
        for t in range(n):
            p = fast_exp(seen[t] - top)
            seen[t] = p
            total += p
        row_max[g] = top if n else -np.inf
        row_sum[g] = total
        for i in range(d):
            acc[g, i] = zero
    block, row = first_block, first_row
    for t in range(n):
        value = v_blocks[table[block], h, row]
        for g in range(group):
            p = scores[g, t]
            ag = acc[g]
            for i in range(d):
                ag[i] += p * widen(value[i])
        row += 1
        if row == block_size:
            block, row = block + 1, 0


@njit(fastmath=FASTMATH, cache=True, inline="always")
def _combine(row_max, row_sum, acc, zero, out):
    """out [group, d] = sum_c acc[c] e^(max_c - M) / sum_c row_sum[c] e^(max_c - M) over spans c (M: the
    max of the span maxima; empty spans weigh e^-inf = 0)."""
    spans, group, d = acc.shape
    for g in range(group):
        top = -np.inf
        for c in range(spans):
            top = max(top, row_max[c, g])
        total = zero
        for i in range(d):
            out[g, i] = zero
        for c in range(spans):
            if row_sum[c, g] == 0:
                continue
            w = np.exp(row_max[c, g] - top)
            total += row_sum[c, g] * w
            for i in range(d):
                out[g, i] += acc[c, g, i] * w
        for i in range(d):
            out[g, i] /= total


def _decode_py(q, k_blocks, v_blocks, block_tables, starts, ends, span, out, zero):
    seqs, kv_heads, block_size = q.shape[0], k_blocks.shape[1], k_blocks.shape[2]
    group, d = q.shape[1] // kv_heads, q.shape[2]
    spans = 1
    for s in range(seqs):
        spans = max(spans, (ends[s] - starts[s] + span - 1) // span)
    row_max = np.empty((seqs, kv_heads, spans, group), dtype=q.dtype)
    row_sum = np.empty_like(row_max)
    acc = np.empty((seqs, kv_heads, spans, group, d), dtype=q.dtype)
    scores = np.empty((seqs, kv_heads, spans, group, span), dtype=q.dtype)
    for item in prange(seqs * kv_heads * spans):
        s, rest = divmod(np.int64(item), kv_heads * spans)  # prange indices are unsigned: keep ints signed
        h, c = divmod(rest, spans)
        lo = starts[s] + c * span
        _span(q[s], h, group, k_blocks, v_blocks, block_tables[s], block_size, lo, min(lo + span, ends[s]),
              zero, row_max[s, h, c], row_sum[s, h, c], acc[s, h, c], scores[s, h, c])
    for item in prange(seqs * kv_heads):
        s, h = divmod(np.int64(item), kv_heads)
        _combine(row_max[s, h], row_sum[s, h], acc[s, h], zero, out[s, h * group:(h + 1) * group])


# Below this many key rows (sequences x KV heads x keys) one thread does it all: waking the other costs
# more than it saves (profiled: at 128 context the parallel version took a quarter of a decode step with
# sleeping OpenMP waits; with the short spin of kernels/__init__.py, 1024 context on SmolLM2-135M's shape,
# 3072 rows, was ~10 ms a step faster in parallel).
PARALLEL_MIN_ROWS = 2048
_decode_parallel = njit(parallel=True, fastmath=FASTMATH, cache=True)(_decode_py)
_decode_serial = njit(fastmath=FASTMATH, cache=True)(_decode_py)


def decode_kernel(rows: int):
    """The compiled kernel for a decode over `rows` key rows in all (sequences x KV heads x keys):
    `kernel(q, k_blocks, v_blocks, block_tables, starts, ends, span, out, zero)`."""
    return _decode_parallel if rows >= PARALLEL_MIN_ROWS else _decode_serial


def _decode(q, k_blocks, v_blocks, block_tables, starts, ends, span, out, zero, rows: int | None = None) -> None:
    """`rows`: key rows in all when the caller knows it without NumPy calls."""
    if rows is None:
        rows = int((ends - starts).sum()) * k_blocks.shape[1]
    decode_kernel(rows)(q, k_blocks, v_blocks, block_tables, starts, ends, span, out, zero)


def _scaled(q: np.ndarray, scale: float | None) -> np.ndarray:
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return np.ascontiguousarray(q * q.dtype.type(scale))


def _check_ranges(starts: np.ndarray, ends: np.ndarray, capacity: np.ndarray | int) -> None:
    if np.any(starts < 0) or np.any(ends <= starts) or np.any(ends > capacity):
        raise ValueError(f"every sequence needs a key range 0 <= start < end <= its capacity; got starts "
                         f"{starts.tolist()}, ends {ends.tolist()}, capacity {np.asarray(capacity).tolist()}")


def paged_decode_attention(q: np.ndarray, k_blocks: np.ndarray, v_blocks: np.ndarray,
                           block_tables: np.ndarray, context_lens: np.ndarray,
                           key_starts: np.ndarray | None = None, scale: float | None = None) -> np.ndarray:
    """Attention of one new query per sequence to its paged K/V, read in place.

    q [S, H_q, d] (float32/float64); k_blocks, v_blocks [num_blocks, H_kv, block_size, d] (float32,
    float16 or bfloat16); block_tables [S, max_blocks] ints (entries past a sequence's blocks unused);
    context_lens [S]: sequence s attends to its keys key_starts[s] .. context_lens[s]-1 (key_starts
    default 0; a sliding window sets it). The new token's K/V must already be written. Returns
    [S, H_q, d] in q's dtype.
    """
    context_lens = np.asarray(context_lens, dtype=np.int64)
    starts = np.zeros_like(context_lens) if key_starts is None else np.asarray(key_starts, dtype=np.int64)
    tables = np.ascontiguousarray(block_tables, dtype=np.int64)
    _check_ranges(starts, context_lens, tables.shape[1] * k_blocks.shape[2])
    q = _scaled(q, scale)
    out = np.empty_like(q)
    _decode(q, as_kernel_array(k_blocks), as_kernel_array(v_blocks), tables, starts, context_lens, SPAN, out,
            q.dtype.type(0))
    return out


def decode_attention(q: np.ndarray, keys: np.ndarray, values: np.ndarray, start: int, end: int,
                     scale: float | None = None) -> np.ndarray:
    """Attention of one query per row, q [B, H_q, d], to a contiguous cache's keys/values
    [B, H_kv, capacity, d] rows start..end-1 (read in place: pass the whole preallocated arrays).
    The contiguous layout is the paged one with one block per sequence."""
    batch = keys.shape[0]
    if not 0 <= start < end <= keys.shape[2]:  # plain ints: this runs once per layer per decode step
        raise ValueError(f"every sequence needs a key range 0 <= start < end <= its capacity; got start "
                         f"{start}, end {end}, capacity {keys.shape[2]}")
    starts, ends = np.full(batch, start, dtype=np.int64), np.full(batch, end, dtype=np.int64)
    q = _scaled(q, scale)
    out = np.empty_like(q)
    tables = np.arange(batch, dtype=np.int64)[:, None]
    keys, values = np.ascontiguousarray(keys), np.ascontiguousarray(values)
    _decode(q, as_kernel_array(keys), as_kernel_array(values), tables, starts, ends, SPAN, out, q.dtype.type(0),
            rows=batch * keys.shape[1] * (end - start))
    return out


# --- the NumPy twins ------------------------------------------------------------------------------------
def decode_attention_reference(q: np.ndarray, keys: np.ndarray, values: np.ndarray, start: int, end: int,
                               scale: float | None = None) -> np.ndarray:
    """softmax(q K^T * scale) V over rows start..end-1, GQA-grouped, K/V widened first."""
    batch, heads, d = q.shape
    kv_heads = keys.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    k = keys[:, :, start:end].astype(q.dtype)
    v = values[:, :, start:end].astype(q.dtype)
    q4 = q.reshape(batch, kv_heads, heads // kv_heads, d) * q.dtype.type(scale)
    scores = q4 @ k.swapaxes(-1, -2)  # [B, H_kv, G, T]
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    return (scores @ v).reshape(batch, heads, d)


def paged_decode_attention_reference(q: np.ndarray, k_blocks: np.ndarray, v_blocks: np.ndarray,
                                     block_tables: np.ndarray, context_lens: np.ndarray,
                                     key_starts: np.ndarray | None = None,
                                     scale: float | None = None) -> np.ndarray:
    """Each sequence's blocks gathered into contiguous [1, H_kv, T, d] K/V, then the contiguous twin."""
    block_size = k_blocks.shape[2]
    out = np.empty_like(q)
    for s, length in enumerate(np.asarray(context_lens)):
        start = 0 if key_starts is None else int(key_starts[s])
        blocks = np.asarray(block_tables[s][: -(-int(length) // block_size)])
        k = np.concatenate(list(k_blocks[blocks]), axis=1)[None]  # [1, H_kv, blocks * block_size, d]
        v = np.concatenate(list(v_blocks[blocks]), axis=1)[None]
        out[s] = decode_attention_reference(q[s:s + 1], k, v, start, int(length), scale)[0]
    return out
