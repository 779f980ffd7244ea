"""Prefill attention: many new queries per sequence against its cached keys and values, on both cores.

The NumPy path (`layers.attend`) makes a [queries, keys] score matrix per head with BLAS, then masks,
exponentiates and sums it in single-threaded NumPy passes through memory: at 1024 tokens of prompt that
was half of the prefill time. Here each work item is (query tile of one sequence, KV head), over every
sequence of a batch in one call (an engine step's prefill chunks, each its own length and cached prefix,
`varlen_prefill_attention`; flat rows as the model's batch holds them): the tile's G
query heads' scores against the keys it can see stay in the core's L2, are exponentiated in place
(fastexp.py: vectorised) and multiplied into the values in the same item, and the items are spread over
the threads. GQA stays compact: the G query heads of a KV head share one item, so each key row is widened
once per tile and read from cache for the whole group.

Which keys a query sees is given per query row as a range lo..hi-1 of key indices (a causal mask, a
sliding window and a chunked prefill's cache all give ranges; `key_ranges` derives them from a boolean
mask and says None when some row's visible keys are not one run, for the NumPy path to take). Keys are
addressed through block tables like the decode kernel (attention.py), so a contiguous cache
[B, H_kv, capacity, d] is the one-block-per-sequence case and a paged pool is read in place; either may be
float32, float16 or bfloat16 (widened once per call into a float32 copy of each sequence's visible span,
the spans one after another, K row-major and V transposed, so that both products are long contiguous dot
products that LLVM vectorises).
"""

from __future__ import annotations

import math

import numba
import numpy as np
from numba import njit, prange

from kvlab.kernels.attention import FASTMATH
from kvlab.kernels.bits import as_kernel_array, widen
from kvlab.kernels.fastexp import fast_exp

SCORE_BYTES = 192 * 1024  # a work item's score tile (query rows x visible keys) sized to stay in L2
MAX_TILE = 32


@njit(fastmath=False, parallel=True, cache=True)
def _widen_spans(k_blocks, v_blocks, tables, klo, koff, keys, values_t):
    """keys[h, koff[s] + t] = K row klo[s] + t of sequence s, head h, widened; values_t[h, :, koff[s] + t]
    likewise for V: every sequence's visible span, one after another (no padding to the longest)."""
    kv_heads = keys.shape[0]
    block_size, d = k_blocks.shape[2], k_blocks.shape[3]
    for item in prange(klo.shape[0] * kv_heads):
        s, h = divmod(np.int64(item), kv_heads)
        for t in range(koff[s + 1] - koff[s]):
            block, row = divmod(klo[s] + t, block_size)
            kr = k_blocks[tables[s, block], h, row]
            vr = v_blocks[tables[s, block], h, row]
            at = koff[s] + t
            for j in range(d):
                keys[h, at, j] = widen(kr[j])
                values_t[h, j, at] = widen(vr[j])


@njit(fastmath=FASTMATH, inline="always", cache=True)
def _dots4x2(a0, a1, a2, a3, b0, b1, n, zero):
    """The eight dot products a_i . b_k over the first n elements: each loaded vector feeds two or four
    multiply-adds, so the loop is bound by the FMA units rather than by loads."""
    s00, s10, s20, s30 = zero, zero, zero, zero
    s01, s11, s21, s31 = zero, zero, zero, zero
    for j in range(n):
        x0, x1 = b0[j], b1[j]
        s00 += a0[j] * x0
        s10 += a1[j] * x0
        s20 += a2[j] * x0
        s30 += a3[j] * x0
        s01 += a0[j] * x1
        s11 += a1[j] * x1
        s21 += a2[j] * x1
        s31 += a3[j] * x1
    return s00, s10, s20, s30, s01, s11, s21, s31


@njit(fastmath=FASTMATH, inline="always", cache=True)
def _dot(a, b, n, zero):
    s = zero
    for j in range(n):
        s += a[j] * b[j]
    return s


@njit(fastmath=FASTMATH, cache=True)
def _products(a, b, offset, out, zero):
    """out[r, t] = a[r] . b[t, offset:offset + n] for a [R, n], b [T, >= offset + n] (C-contiguous rows,
    so the loops vectorise): blocks of four rows of a by two of b. Called, not inlined: the scores and
    the values products share one compile (inlined twice, they doubled _prefill's cold compile)."""
    rows, cols, n = a.shape[0], out.shape[1], a.shape[1]
    for r in range(0, rows - rows % 4, 4):
        a0, a1, a2, a3 = a[r], a[r + 1], a[r + 2], a[r + 3]
        for t in range(0, cols - cols % 2, 2):
            o = _dots4x2(a0, a1, a2, a3, b[t][offset:], b[t + 1][offset:], n, zero)
            out[r, t], out[r + 1, t], out[r + 2, t], out[r + 3, t] = o[0], o[1], o[2], o[3]
            out[r, t + 1], out[r + 1, t + 1], out[r + 2, t + 1], out[r + 3, t + 1] = o[4], o[5], o[6], o[7]
        for t in range(cols - cols % 2, cols):
            for k in range(4):
                out[r + k, t] = _dot(a[r + k], b[t][offset:], n, zero)
    for r in range(rows - rows % 4, rows):
        for t in range(cols):
            out[r, t] = _dot(a[r], b[t][offset:], n, zero)


@njit(fastmath=FASTMATH, inline="always", cache=True)
def _prefill_item(q, keys, values_t, klo, koff, lo, hi, tile_seq, tile_first, tile_last, out, zero, mine, item):
    """One work item of _prefill: query tile c = item // H_kv (rows tile_first[c]..tile_last[c]-1 of
    sequence tile_seq[c]), KV head item % H_kv."""
    heads, d = q.shape[1], q.shape[2]
    kv_heads = keys.shape[0]
    group = heads // kv_heads
    c, h = divmod(item, kv_heads)
    s, i0 = tile_seq[c], tile_first[c]
    n_q = tile_last[c] - i0
    first, last = np.int64(1) << 62, np.int64(0)  # the union of the tile's ranges
    for i in range(i0, i0 + n_q):
        if hi[i] > lo[i]:
            first, last = min(first, lo[i]), max(last, hi[i])
    n = max(last - first, 0)
    if n == 0:
        out[i0:i0 + n_q, h * group:(h + 1) * group] = zero
        return
    rows = group * n_q  # row r is query head h*group + r // n_q at query row i0 + r % n_q
    base = koff[s] + first - klo[s]  # the tile's first key in the flat spans
    qt = mine[:rows * d].reshape((rows, d))
    scores = mine[rows * d:rows * (d + n)].reshape((rows, n))
    pv = mine[rows * (d + n):rows * (2 * d + n)].reshape((rows, d))
    for r in range(rows):
        g, i = divmod(r, n_q)
        qt[r] = q[i0 + i, h * group + g]
    _products(qt, keys[h, base:base + n], 0, scores, zero)
    for r in range(rows):
        i = i0 + r % n_q
        a, b = max(lo[i] - first, 0), max(hi[i] - first, 0)
        seen = scores[r, a:b]  # loops from 0 over a slice: no negative-index checks, so they vectorise
        top = seen[0] if b > a else zero
        for t in range(seen.shape[0]):
            top = max(top, seen[t])
        total = zero
        for t in range(seen.shape[0]):
            p = fast_exp(seen[t] - top)
            seen[t] = p
            total += p
        scale = 1 / total if total > 0 else zero
        for t in range(seen.shape[0]):
            seen[t] *= scale
        scores[r, :a] = zero
        scores[r, b:] = zero
    _products(scores, values_t[h], base, pv, zero)
    for r in range(rows):
        g, i = divmod(r, n_q)
        out[i0 + i, h * group + g] = pv[r]


@njit(parallel=True, fastmath=FASTMATH, cache=True)
def _prefill(q, keys, values_t, klo, koff, lo, hi, tile_seq, tile_first, tile_last, most_keys, workers, out,
             zero):
    """out[i, H] = softmax over keys lo[i]..hi[i]-1 of its sequence of q[i, H] . K, times V.

    q [N, H_q, d] pre-scaled, the rows of every sequence one after another; keys [H_kv, sum of spans, d]
    and values_t [H_kv, d, sum of spans] hold key indices klo[s].. of sequence s from koff[s] on (see
    _widen_spans); the query tiles are rows tile_first[c]..tile_last[c]-1 of sequence tile_seq[c], and no
    tile sees more than `most_keys` keys. A row with no visible key gives zeros.

    Work items are (query tile, KV head), over every sequence at once. The parallel loop is over
    `workers` (the thread count), each taking every workers-th item: under a causal mask a tile's cost
    grows with its place in its sequence, the tiles are listed by that place, and interleaving gives every
    thread cheap and dear tiles alike. Each worker has its own scratch, made before the loop: allocating
    inside a parallel loop serialised the threads (measured: 2 threads no faster than 1).
    """
    d = q.shape[2]
    group = q.shape[1] // keys.shape[0]
    items = tile_seq.shape[0] * keys.shape[0]
    most_rows = 0
    for c in range(tile_seq.shape[0]):
        most_rows = max(most_rows, group * (tile_last[c] - tile_first[c]))
    scratch = np.empty((workers, most_rows * (most_keys + 2 * d)), dtype=q.dtype)
    for worker in prange(workers):
        for item in range(worker, items, workers):
            _prefill_item(q, keys, values_t, klo, koff, lo, hi, tile_seq, tile_first, tile_last, out, zero,
                          scratch[worker], item)


def key_ranges(mask: np.ndarray | None, batch: int, num_new: int, num_keys: int
               ) -> tuple[np.ndarray, np.ndarray] | None:
    """Per query row, the visible keys as lo..hi-1 ([B, T] int64 each), from a mask [T, Tk] or
    [B, T, Tk] (None: every key visible); None when some row's visible keys are not one contiguous run."""
    if mask is None:
        return (np.zeros((batch, num_new), dtype=np.int64), np.full((batch, num_new), num_keys, dtype=np.int64))
    m = np.broadcast_to(mask, (batch, num_new, num_keys))
    any_visible = m.any(axis=-1)
    lo = np.where(any_visible, np.argmax(m, axis=-1), 0)
    hi = np.where(any_visible, num_keys - np.argmax(m[..., ::-1], axis=-1), 0)
    if np.any(m.sum(axis=-1) != hi - lo):
        return None
    return lo.astype(np.int64), hi.astype(np.int64)


def _tile_for(rows_per_query: int, span: int, num_q: int) -> int:
    """Queries per work item: the score tile within SCORE_BYTES, at least 4 (a block of dot products)."""
    tile = SCORE_BYTES // max(4 * rows_per_query * span, 1)
    return int(max(4, min(MAX_TILE, tile, num_q)))


def _query_tiles(query_starts: np.ndarray, tile: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tile_seq, tile_first, tile_last) [C]: each sequence's rows cut into tiles of `tile` (rows
    tile_first[c]..tile_last[c]-1 of sequence tile_seq[c]), listed by the tile's place in its sequence:
    every sequence's first tile, then every second, ..."""
    seq, first = [], []
    lens = np.diff(query_starts)
    for c in range(int(-(-lens.max() // tile)) if len(lens) else 0):
        for s in np.flatnonzero(lens > c * tile):
            seq.append(s)
            first.append(query_starts[s] + c * tile)
    seq_a, first_a = np.array(seq, dtype=np.int64), np.array(first, dtype=np.int64)
    last = np.minimum(first_a + tile, query_starts[seq_a + 1])
    return seq_a, first_a, last


def varlen_prefill_attention(q: np.ndarray, k_blocks: np.ndarray, v_blocks: np.ndarray,
                             block_tables: np.ndarray, query_starts: np.ndarray, lo: np.ndarray,
                             hi: np.ndarray, scale: float | None = None) -> np.ndarray:
    """Attention of every sequence's new queries to its own paged K/V, read in place, in one call.

    q [N, H_q, d] (float32/float64): rows query_starts[s]..query_starts[s + 1]-1 are sequence s's
    (query_starts [S + 1], any lengths); k_blocks, v_blocks [num_blocks, H_kv, block_size, d] in float32,
    float16 or bfloat16; block_tables [S, max_blocks]; lo, hi [N]: row i sees key indices lo[i]..hi[i]-1
    of its sequence (written already). Returns [N, H_q, d] in q's dtype.
    """
    rows, heads, d = q.shape
    kv_heads = k_blocks.shape[1]
    starts = np.asarray(query_starts, dtype=np.int64)
    lo, hi = np.asarray(lo, dtype=np.int64), np.asarray(hi, dtype=np.int64)
    tables = np.ascontiguousarray(block_tables, dtype=np.int64)
    seqs = tables.shape[0]
    capacity = tables.shape[1] * k_blocks.shape[2]
    if heads % kv_heads or starts.shape != (seqs + 1,) or starts[0] != 0 or starts[-1] != rows \
            or np.any(np.diff(starts) < 0) or lo.shape != (rows,) or hi.shape != (rows,) or np.any(lo < 0) \
            or np.any(hi > capacity):
        raise ValueError(f"prefill attention needs H_q a multiple of H_kv, query_starts [S + 1] from 0 to "
                         f"N rising and key ranges [N] within 0..{capacity}; got q {q.shape}, {kv_heads} "
                         f"KV heads, {seqs} block tables, query_starts {starts.shape}, ranges {lo.shape}")
    seq_of_row = np.repeat(np.arange(seqs), np.diff(starts))
    seen = hi > lo
    klo = np.full(seqs, np.iinfo(np.int64).max, dtype=np.int64)
    np.minimum.at(klo, seq_of_row[seen], lo[seen])
    khi = np.zeros(seqs, dtype=np.int64)
    np.maximum.at(khi, seq_of_row[seen], hi[seen])
    klo = np.where(khi > 0, klo, 0)
    spans = np.maximum(khi - klo, 0)
    koff = np.concatenate([[0], np.cumsum(spans)]).astype(np.int64)
    keys = np.empty((kv_heads, int(koff[-1]), d), dtype=q.dtype)
    values_t = np.empty((kv_heads, d, int(koff[-1])), dtype=q.dtype)
    _widen_spans(as_kernel_array(k_blocks), as_kernel_array(v_blocks), tables, klo, koff, keys, values_t)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    q = np.ascontiguousarray(q * q.dtype.type(scale))
    out = np.empty_like(q)
    most_keys = int(spans.max()) if seqs else 0
    tile = _tile_for(heads // kv_heads, most_keys, int(np.diff(starts).max()) if seqs else 1)
    tile_seq, tile_first, tile_last = _query_tiles(starts, tile)
    _prefill(q, keys, values_t, klo, koff, lo, hi, tile_seq, tile_first, tile_last, most_keys,
             numba.get_num_threads(), out, q.dtype.type(0))
    return out


def paged_prefill_attention(q: np.ndarray, k_blocks: np.ndarray, v_blocks: np.ndarray,
                            block_tables: np.ndarray, lo: np.ndarray, hi: np.ndarray,
                            scale: float | None = None) -> np.ndarray:
    """Attention of T new queries per sequence to its paged K/V, read in place (`varlen_prefill_attention`
    with every sequence T long).

    q [S, H_q, T, d] (float32/float64); k_blocks, v_blocks [num_blocks, H_kv, block_size, d] in float32,
    float16 or bfloat16; block_tables [S, max_blocks]; lo, hi [S, T]: query i of sequence s sees key
    indices lo[s, i]..hi[s, i]-1 (written already). Returns [S, H_q, T, d] in q's dtype.
    """
    seqs, heads, num_q, d = q.shape
    lo, hi = np.asarray(lo, dtype=np.int64), np.asarray(hi, dtype=np.int64)
    if lo.shape != (seqs, num_q) or hi.shape != (seqs, num_q):
        raise ValueError(f"prefill attention needs key ranges [S, T] = {(seqs, num_q)}; got {lo.shape}")
    flat = q.transpose(0, 2, 1, 3).reshape(seqs * num_q, heads, d)
    out = varlen_prefill_attention(flat, k_blocks, v_blocks, block_tables,
                                   np.arange(seqs + 1, dtype=np.int64) * num_q, lo.reshape(-1), hi.reshape(-1),
                                   scale)
    return out.reshape(seqs, num_q, heads, d).transpose(0, 2, 1, 3)


def prefill_attention(q: np.ndarray, keys: np.ndarray, values: np.ndarray, lo: np.ndarray, hi: np.ndarray,
                      scale: float | None = None) -> np.ndarray:
    """`paged_prefill_attention` over a contiguous cache [B, H_kv, capacity, d] (one block per sequence)."""
    batch = keys.shape[0]
    tables = np.arange(batch, dtype=np.int64)[:, None]
    return paged_prefill_attention(q, np.ascontiguousarray(keys), np.ascontiguousarray(values), tables, lo, hi,
                                   scale)
