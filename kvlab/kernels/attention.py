"""Decode attention that reads the K/V cache where it lies: paged blocks or contiguous rows, float or codes.

One new query per sequence attends to its cached keys and values. The cache may hold float32, float16 or
bfloat16 rows, or int8 / int4 / fp8 codes with their float16 scales (attention_formats.StoredCodes), read
where they lie: an int8 row is a quarter of float32's bytes, and reading fewer bytes is the point of a
quantized cache. No copy of the cache is made; a tile of TILE rows at a time is widened (bits.py) or
dequantized into a scratch tile of the compute dtype that stays in L1, shared by the G query heads.

GQA stays compact (ARCHITECTURE.md invariant 3): the G query heads of a KV head are one work item, so each key and
value row is read once for the whole group. A work item takes its keys a span (SPAN keys) at a time, in
two passes: the G scores of every key in the span (a TILE of rows read or widened at a time), the
softmax weights over the whole span, then one pass over the span's values. For float32 tiles of head dim
32/64/128 the two products are explicit vector code (attention_simd.py: eight keys' scores in one
register, the output row held in registers across the tile); other dims and float64 take the numba
loops below (`_tile_scores`, `_tile_values`), which are the same sums in another order. No step depends
on where a tile or a block ends (each score is its own dot product, values are added key by key, the
softmax sees the whole span), so a query row gets the same bits from a paged pool of any block size as
from a contiguous cache, in a decode step or in a prefill that runs through this kernel (the batch-
invariant attention of `activations="q8"`, model/attention.py).

Both layouts are one kernel. The paged cache is `k_blocks[num_blocks, H_kv, block_size, d]` with a
`block_table` per sequence (key t of sequence s is row t % block_size of block block_table[s, t //
block_size]); a contiguous cache [B, H_kv, capacity, d] is the same thing with one block per sequence.

Spans start at each row's first visible key; each yields its row max, exp-sum and unnormalised value
sum, and the spans are combined in order, rescaled to the common max. With few (row, KV head) items,
each span is a work item of its own (split-K, as flash-decoding does) so that both cores have work at
batch 1 with few KV heads and a long context; the arithmetic is the same either way. The NumPy twins
below gather, widen (or dequantize) and softmax in the plain way; tests/test_kernels*.py hold each kernel
to its twin.
"""

from __future__ import annotations

import math

import numba
import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from kvlab.kernels.attention_simd import dequantize_int4, dequantize_int8, simd_scores, simd_values, widen_run
from kvlab.kernels.attention_encode import encode_into
from kvlab.kernels.attention_formats import FLOAT, FP8_E4M3, INT4, INT8, StoredCodes
from kvlab.kernels.bits import as_kernel_array
from kvlab.kernels.compile_names import renamed
from kvlab.kernels.fastexp import fast_exp

FASTMATH = {"reassoc", "contract"}
TILE = 32   # keys whose scores are computed before their values are read (scratch [G, TILE] stays in L1)
SPAN = 256  # keys per work item, a multiple of TILE: at 4096 context, batch 1, 3 KV heads: 48 items
_E4M3_SCALE = np.float32(2.0 ** 120)  # fp8 bits moved into float32's layout are off by 2^(127 - bias)
_E5M2_SCALE = np.float32(2.0 ** 112)
_U7F, _U80 = np.uint32(0x7F), np.uint32(0x80)
_S20, _S21, _S24 = np.uint32(20), np.uint32(21), np.uint32(24)


@njit(inline="always")
def _e4m3(code):
    """float32 of an fp8 e4m3fn code (finite: the cache saturates at 448, never stores NaN); subnormals
    come out exact, as float16's do in bits.widen."""
    c = np.uint32(code)
    return np.uint32(((c & _U80) << _S24) | ((c & _U7F) << _S20)).view(np.float32) * _E4M3_SCALE


@njit(inline="always")
def _e5m2(code):
    """float32 of an fp8 e5m2 code: float16's top byte, widened the same way."""
    c = np.uint32(code)
    return np.uint32(((c & _U80) << _S24) | ((c & _U7F) << _S21)).view(np.float32) * _E5M2_SCALE


@njit(fastmath=FASTMATH, cache=True)
def _span_softmax(scores, n, row_max, row_sum, zero):
    """A span's scores [G, >= n] become e^(s - max) in place, key by key; row_max, row_sum [G] get the
    span's max and the sum of those weights. Over the whole span at once (not tile by tile, as an online
    softmax would), so the result does not depend on where tiles or blocks cut the span."""
    for g in range(scores.shape[0]):
        seen = scores[g]
        top = seen[0]
        for t in range(1, n):
            top = max(top, seen[t])
        total = zero
        for t in range(n):
            p = fast_exp(seen[t] - top)
            seen[t] = p
            total += p
        row_max[g] = top
        row_sum[g] = total


@njit(fastmath=FASTMATH, cache=True)
def _tile_scores(q, first_head, scores, col, rows, b, h, r0, n, zero):
    """scores[g, col + t] = q[first_head + g] . rows[b, h, r0 + t] for t < n: one key at a time, every
    key's dot product the same loop wherever the key sits in its tile (the numba twin of simd_scores,
    for float64 and head dims it has no vector code for)."""
    heads, d = scores.shape[0], q.shape[1]
    for t in range(n):
        key = rows[b, h, r0 + t]
        for g in range(heads):
            qg = q[first_head + g]
            s = zero
            for i in range(d):
                s += qg[i] * key[i]
            scores[g, col + t] = s


@njit(fastmath=FASTMATH, cache=True)
def _tile_values(scores, col, rows, b, h, r0, n, acc):
    """acc[g] += sum_t scores[g, col + t] rows[b, h, r0 + t], key by key in order (so tiles may cut the
    keys anywhere and give the same bits), as simd_values."""
    heads, d = acc.shape
    for t in range(n):
        value = rows[b, h, r0 + t]
        for g in range(heads):
            p = scores[g, col + t]
            ag = acc[g]
            for i in range(d):
                ag[i] += p * value[i]


def _tile(stored, scale, zero_point, kind, group, b, h, r0, n, tile, zero):  # pragma: no cover - overloaded
    """Rows r0..r0+n-1 of block b, head h as float rows of the compute dtype: (array, b, h, r0) to index.
    Rows already in that dtype are read where they lie; others (float16/bfloat16 bits, codes) are
    widened or dequantized once into `tile` [1, 1, TILE, d], so the G query heads share the work."""
    raise NotImplementedError


def _tile_in_place(stored, scale, zero_point, kind, group, b, h, r0, n, tile, zero):
    return stored, b, h, r0


def _tile_widened(stored, scale, zero_point, kind, group, b, h, r0, n, tile, zero):
    """The n rows are contiguous within their block: widen them as one flat run (one vectorised loop
    instead of a short loop per row)."""
    d = tile.shape[3]
    widen_run(stored[b, h].ravel()[r0 * d:(r0 + n) * d], tile[0, 0].ravel()[:n * d], zero)
    return tile, 0, 0, 0


def _tile_decoded(stored, scale, zero_point, kind, group, b, h, r0, n, tile, zero):
    """x = zero_j + code * scale_j per group j (the float16 pair as stored), or an fp8 code's value. The
    n rows and their scales are contiguous within the block, so they run as one flat sequence: slices of
    the [b, h] views, indexed from 0 (an index with an offset added kept LLVM from vectorising)."""
    d = tile.shape[3]
    dst, src = tile[0, 0].ravel(), stored[b, h].ravel()
    if kind == INT8 or kind == INT4:
        groups, g0, per_byte = n * d // group, r0 * (d // group), 1 + (kind == INT4)  # (no ternary: see fastexp)
        s_run, z_run = scale[b, h].ravel()[g0:g0 + groups], zero_point[b, h].ravel()[g0:g0 + groups]
        run = src[r0 * d // per_byte:(r0 + n) * d // per_byte]
        if kind == INT8:
            dequantize_int8(run, s_run, z_run, group, dst, zero)
        else:
            dequantize_int4(run, s_run, z_run, group, dst, zero)
        return tile, 0, 0, 0
    src = src[r0 * d:(r0 + n) * d]
    if kind == FP8_E4M3:
        for i in range(n * d):
            dst[i] = zero + _e4m3(src[i])
    else:
        for i in range(n * d):
            dst[i] = zero + _e5m2(src[i])
    return tile, 0, 0, 0


@overload(_tile, inline="always")
def _tile_overload(stored, scale, zero_point, kind, group, b, h, r0, n, tile, zero):
    if stored.dtype == tile.dtype:
        return _tile_in_place
    return _tile_decoded if stored.dtype == types.uint8 else _tile_widened


@njit(fastmath=FASTMATH, cache=True)
def _span(q, h, kc, ks, kz, vc, vs, vz, kind, group, table, lo, hi, zero, row_max, row_sum, acc, scores, k_tile,
          v_tile):
    """Keys lo..hi-1 (at most SPAN) of one sequence (through its block `table`) against the G query heads
    of KV head h (rows h*G.. of q [H_q, d], pre-scaled): this span's per-head max, exp-sum and
    unnormalised value sum acc [G, d]. Two passes over the span: every key's score into `scores`
    [G, >= SPAN + 8], the softmax weights over the span, then the values. Tiles (TILE rows, never
    crossing a block) only decide where rows are read or widened: each score is its own dot product and
    the values are added key by key, so a span gives the same bits whatever the block size (paged or
    contiguous, a prefill or a decode; ARCHITECTURE.md invariant 13). `scores` and the tiles
    [1, 1, TILE, d] are scratch from the caller: an allocation inside a parallel loop serialised the
    threads (measured: 2 threads took as long as 1 at 4096 keys; with the scratch hoisted, 1.9x faster)."""
    block_size = kc.shape[2]
    block, row, first = lo // block_size, lo % block_size, lo
    while first < hi:
        n = min(TILE, hi - first, block_size - row)
        rows, tb, th, tr = _tile(kc, ks, kz, kind, group, table[block], h, row, n, k_tile, zero)
        simd_scores(q, h * scores.shape[0], scores, first - lo, rows, tb, th, tr, n, _tile_scores, zero)
        first, row = first + n, row + n
        if row == block_size:
            block, row = block + 1, 0
    _span_softmax(scores, hi - lo, row_max, row_sum, zero)
    acc[:] = zero
    block, row, first = lo // block_size, lo % block_size, lo
    while first < hi:
        n = min(TILE, hi - first, block_size - row)
        rows, tb, th, tr = _tile(vc, vs, vz, kind, group, table[block], h, row, n, v_tile, zero)
        simd_values(scores, first - lo, rows, tb, th, tr, n, acc, _tile_values)
        first, row = first + n, row + n
        if row == block_size:
            block, row = block + 1, 0


@njit(fastmath=FASTMATH, cache=True, error_model="numpy")  # divides in a loop: gemv.py says why
def _combine(row_max, row_sum, acc, zero, out):
    """out [group, d] = sum_c acc[c] e^(max_c - M) / sum_c row_sum[c] e^(max_c - M) over spans c (M: the
    max of the span maxima; empty spans weigh e^-inf = 0)."""
    spans, group, d = acc.shape
    for g in range(group):
        top = row_max[0, g]
        for c in range(spans):
            top = max(top, row_max[c, g])
        total = zero
        for i in range(d):
            out[g, i] = zero
        for c in range(spans):
            if row_sum[c, g] == 0:
                continue
            w = fast_exp(row_max[c, g] - top)
            total += row_sum[c, g] * w
            for i in range(d):
                out[g, i] += acc[c, g, i] * w
        for i in range(d):
            out[g, i] /= total


def _decode_py(q, kc, ks, kz, vc, vs, vz, kind, group, block_tables, starts, ends, span, threads, out, zero):
    """Query row s (of q [S, H_q, d], pre-scaled) attends to keys starts[s]..ends[s]-1 through block_tables[s].

    Each row's keys are cut into spans of `span` from starts[s]; each span gives its max, exp-sum and value
    sum (_span) and the spans are combined in order (_combine). Either one work item per (row, KV head)
    runs its spans one after another (many rows: a batch, a prefill), or, with fewer such items than
    SPLIT_ITEMS, one item per span (split-K: a long context at batch 1 still feeds every thread). Both
    do the same arithmetic, so a row's result never depends on the rows beside it or on the thread count.
    Scratch is one set per thread (numba.get_thread_id < `threads`, numba.get_num_threads() passed in: asked
    inside, it keeps numba from caching the kernel), not per item: a prefill has thousands of items."""
    seqs, kv_heads = q.shape[0], kc.shape[1]
    heads, d = q.shape[1] // kv_heads, q.shape[2]
    spans = 1
    for s in range(seqs):
        spans = max(spans, (ends[s] - starts[s] + span - 1) // span)
    scores = np.empty((threads, heads, span + 8), dtype=q.dtype)
    tiles = np.empty((threads, 2, 1, 1, TILE, d), dtype=q.dtype)
    split = spans > 1 and seqs * kv_heads < SPLIT_ITEMS
    # split: a span's partials stay until every span is done (one slot per (row, KV head)); else each item
    # combines its own spans at once (one slot per thread)
    per_item, slots = (spans, seqs * kv_heads) if split else (1, threads)
    row_max = np.empty((slots, spans, heads), dtype=q.dtype)
    row_sum = np.empty_like(row_max)
    acc = np.empty((slots, spans, heads, d), dtype=q.dtype)
    # one parallel loop, not one per mode (each prange compiles apart: three took ~9 s per kv dtype, cold)
    for item in prange(seqs * kv_heads * per_item):
        pair, first = divmod(np.int64(item), per_item)  # prange indices are unsigned: keep ints signed
        s, h = divmod(pair, kv_heads)
        me = numba.get_thread_id()
        slot = pair if split else me
        count = (ends[s] - starts[s] + span - 1) // span
        last = first + 1 if split else count
        for c in range(first, last):
            lo = starts[s] + c * span
            if lo >= ends[s]:  # past this row's keys: an empty span weighs nothing in _combine
                row_max[slot, c] = -np.inf
                row_sum[slot, c] = zero
                continue
            _span(q[s], h, kc, ks, kz, vc, vs, vz, kind, group, block_tables[s], lo, min(lo + span, ends[s]), zero,
                  row_max[slot, c], row_sum[slot, c], acc[slot, c], scores[me], tiles[me, 0], tiles[me, 1])
        if not split:
            _combine(row_max[me, :count], row_sum[me, :count], acc[me, :count], zero,
                     out[s, h * heads:(h + 1) * heads])
    if split:  # fewer than SPLIT_ITEMS (row, KV head) pairs: their combines are cheap, one after another
        for pair in range(seqs * kv_heads):
            s, h = divmod(pair, kv_heads)
            _combine(row_max[pair], row_sum[pair], acc[pair], zero, out[s, h * heads:(h + 1) * heads])


SPLIT_ITEMS = 16  # fewer (row, KV head) items than this: one item per span instead, so both threads work


# Below this many key rows (sequences x KV heads x keys) one thread does it all. Why so few: numba's worker
# spins ~25 us after a parallel region (GOMP_SPINCOUNT 1000, kernels/__init__.py), then sleeps, and waking
# it costs 15-25 us on these VMs. A serial attention of 20-30 us between a layer's q/k/v product and its
# output product let it fall asleep in every layer, and the output product paid the wake: a second thread
# bought nothing at 128 context. Run in parallel right after the q/k/v product, attention keeps it awake.
# (Spans stay SPAN keys whatever the thread count or batch, so a sequence's result does not depend on them.)
PARALLEL_MIN_ROWS = 256


_decode_parallel = njit(parallel=True, fastmath=FASTMATH, cache=True)(_decode_py)
_decode_serial = njit(fastmath=FASTMATH, cache=True)(renamed(_decode_py, "_decode_serial_py"))
_NO_SCALES = np.zeros((1, 1, 1, 1), dtype=np.int16)  # what a float store passes for scales and zeros


@njit(inline="always")
def _split_heads(qkv, heads, kv_heads, d, scale):
    """A block's q/k/v rows [S, (H_q + 2 H_kv) d] as q heads times `scale` [S, H_q, d] (the product the
    unfused step's `PagedDecodeCall` takes: no fastmath here, so it is not contracted into a later sum),
    k and v heads [S, H_kv, d], each a copy."""
    seqs = qkv.shape[0]
    scaled = np.empty((seqs, heads, d), dtype=qkv.dtype)
    keys = np.empty((seqs, kv_heads, d), dtype=qkv.dtype)
    values = np.empty((seqs, kv_heads, d), dtype=qkv.dtype)
    flat_q, flat_k, flat_v = scaled.reshape(seqs, heads * d), keys.reshape(seqs, -1), values.reshape(seqs, -1)
    for s in range(seqs):
        row = qkv[s]
        for i in range(heads * d):
            flat_q[s, i] = row[i] * scale
        for i in range(kv_heads * d):
            flat_k[s, i] = row[heads * d + i]
            flat_v[s, i] = row[(heads + kv_heads) * d + i]
    return scaled, keys, values


@njit(fastmath=False, cache=True)
def write_and_attend(qkv, heads, k_blocks, v_blocks, slot_blocks, slot_rows, tables, starts, ends, span, threads,
                     scale, out, zero):
    """Attention from a block's q/k/v rows inside a one-call block (kernels/decode_block.py), each row a
    one-query "sequence" of the decode kernel: qkv [S, (H_q + 2 H_kv) d] as `qkv_rope` leaves them; row
    s's k and v heads are written to row slot_rows[s] of block slot_blocks[s] of k_blocks, v_blocks
    ([blocks, H_kv, block_size, d], a float pool of the compute dtype, or a contiguous cache's arrays with
    one block per sequence), every row's before any attends (as the unfused write does), its q heads
    scaled, then `_decode` as model/attention.py calls it unfused: the same copy, the same product by
    `scale` and the same kernel, so each row gets the unfused step's bits. Always the parallel variant:
    with no Python between a layer's products, its worker is awake (PARALLEL_MIN_ROWS says why the
    unfused step is not)."""
    kv_heads, d = k_blocks.shape[1], k_blocks.shape[3]
    scaled, keys, values = _split_heads(qkv, heads, kv_heads, d, scale)
    for s in range(qkv.shape[0]):
        block, slot = slot_blocks[s], slot_rows[s]
        for h in range(kv_heads):
            k_blocks[block, h, slot] = keys[s, h]
            v_blocks[block, h, slot] = values[s, h]
    # the operands as the unfused call types them (a writable array, int64s), not the global `_NO_SCALES`
    # (read-only inside a kernel) and literal ints: otherwise numba compiles the decode kernel a second time
    # for this caller (~10 s cold, the kernel and its span function)
    no_scales = np.zeros((1, 1, 1, 1), dtype=np.int16)
    _decode_parallel(scaled, k_blocks, no_scales, no_scales, v_blocks, no_scales, no_scales, np.int64(FLOAT),
                     np.int64(1), tables, starts, ends, span, threads, out, zero)


@njit(fastmath=False, cache=True)
def write_codes_and_attend(qkv, heads, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, kind, group, slot_blocks,
                           slot_rows, tables, starts, ends, span, threads, scale, out, zero):
    """`write_and_attend` over a pool of int8 / int4 / fp8 codes (`kernel_operands` of each layer's
    StoredCodes: codes as uint8, scale and zero bits as int16): the k and v rows quantized by
    attention_encode.encode_into, the compiled writer the pool's own write calls (so the same codes,
    scales and zeros), then the decode kernel reads them in place."""
    kv_heads, d = k_codes.shape[1], out.shape[2]
    scaled, keys, values = _split_heads(qkv, heads, kv_heads, d, scale)
    encode_into(keys, k_codes, k_scale.view(np.uint16), k_zero.view(np.uint16), slot_blocks, slot_rows, kind, group)
    encode_into(values, v_codes, v_scale.view(np.uint16), v_zero.view(np.uint16), slot_blocks, slot_rows, kind,
                group)
    _decode_parallel(scaled, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, kind, group, tables, starts, ends,
                     span, threads, out, zero)


def decode_kernel(rows: int):
    """The compiled kernel for a decode over `rows` key rows in all (sequences x KV heads x keys):
    `kernel(q, *kernel_operands(keys), *kernel_operands(values)[:3], kind, group, block_tables, starts,
    ends, span, kernel_threads(), out, zero)`; see `_decode`."""
    return _decode_parallel if rows >= PARALLEL_MIN_ROWS else _decode_serial


def kernel_operands(stored: np.ndarray | StoredCodes) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, int]:
    """(codes or rows, scale bits, zero bits, kind, group) for one layer's keys or values as a store holds
    them: a float array (float16/bfloat16 as their bits, no scales) or StoredCodes."""
    if isinstance(stored, StoredCodes):
        scale, zero = stored.scale, stored.zero
        if scale.size == 0:
            scale = zero = _NO_SCALES
        return stored.codes.view(np.uint8), scale.view(np.int16), zero.view(np.int16), stored.kind, stored.group
    return as_kernel_array(np.ascontiguousarray(stored)), _NO_SCALES, _NO_SCALES, FLOAT, 1


def kernel_threads() -> int:
    """The thread count the kernel sizes its per-thread scratch by: asked once per forward, not per layer."""
    return numba.get_num_threads()


def _decode(q, keys, values, block_tables, starts, ends, out, rows: int, threads: int) -> None:
    """`rows`: key rows in all (it picks the serial or the parallel kernel), known to the caller."""
    kc, ks, kz, kind, group = kernel_operands(keys)
    vc, vs, vz, value_kind, _ = kernel_operands(values)
    if value_kind != kind or kc.dtype != vc.dtype:
        raise ValueError("keys and values must be stored alike")
    decode_kernel(rows)(q, kc, ks, kz, vc, vs, vz, kind, group, block_tables, starts, ends, SPAN, threads, out,
                        q.dtype.type(0))


def typed_scale(scale: float | None, head_dim: int, dtype: np.dtype) -> np.generic:
    """What the queries are multiplied by, in their dtype: `scale`, or 1/sqrt(head_dim) when None. Every
    path that scales them (the unfused calls, the one-call block's operands) takes it from here, so they
    multiply by the same value."""
    return np.dtype(dtype).type(1.0 / math.sqrt(head_dim) if scale is None else scale)


def _scaled(q: np.ndarray, scale: float | None) -> np.ndarray:
    return np.ascontiguousarray(q * typed_scale(scale, q.shape[-1], q.dtype))


def _check_ranges(starts: np.ndarray, ends: np.ndarray, capacity: np.ndarray | int) -> None:
    if np.any(starts < 0) or np.any(ends <= starts) or np.any(ends > capacity):
        raise ValueError(f"every sequence needs a key range 0 <= start < end <= its capacity; got starts "
                         f"{starts.tolist()}, ends {ends.tolist()}, capacity {np.asarray(capacity).tolist()}")


def _shape(stored: np.ndarray | StoredCodes) -> tuple[int, ...]:
    """[blocks, H_kv, rows, d] of a layer's storage (int4 codes hold d/2 bytes a row)."""
    if isinstance(stored, StoredCodes):
        blocks, heads, rows, width = stored.codes.shape
        return blocks, heads, rows, 2 * width if stored.kind == INT4 else width
    return stored.shape


def paged_decode_attention(q: np.ndarray, k_blocks: np.ndarray | StoredCodes, v_blocks: np.ndarray | StoredCodes,
                           block_tables: np.ndarray, context_lens: np.ndarray,
                           key_starts: np.ndarray | None = None, scale: float | None = None) -> np.ndarray:
    """Attention of one new query per sequence to its paged K/V, read in place.

    q [S, H_q, d] (float32/float64); k_blocks, v_blocks [num_blocks, H_kv, block_size, d] (float32,
    float16 or bfloat16), or StoredCodes of that shape; block_tables [S, max_blocks] ints (entries past a
    sequence's blocks unused); context_lens [S]: sequence s attends to its keys key_starts[s] ..
    context_lens[s]-1 (key_starts default 0; a sliding window sets it). The new token's K/V must already
    be written. Returns [S, H_q, d] in q's dtype.
    """
    _, kv_heads, block_size, _ = _shape(k_blocks)
    return PagedDecodeCall(block_tables, context_lens, key_starts, block_size, kv_heads)(q, k_blocks, v_blocks, scale)


class PagedDecodeCall:
    """The per-step half of `paged_decode_attention`, done once for every layer that shares a block table.

    A decode step calls attention once per layer with the same block tables and key ranges: their dtype
    conversion and range check (a dozen NumPy calls, ~30 us) belong to the step, not to each of its 30 layers.
    """

    def __init__(self, block_tables: np.ndarray, context_lens: np.ndarray, key_starts: np.ndarray | None,
                 block_size: int, kv_heads: int, threads: int | None = None) -> None:
        """`threads`: kernel_threads(), when the caller asked already (once per forward for all its plans)."""
        self.ends = np.asarray(context_lens, dtype=np.int64)
        self.starts = np.zeros(len(self.ends), dtype=np.int64) if key_starts is None else \
            np.asarray(key_starts, dtype=np.int64)
        self.tables = np.ascontiguousarray(block_tables, dtype=np.int64)
        starts, ends, capacity = self.starts.tolist(), self.ends.tolist(), self.tables.shape[1] * block_size
        if any(not 0 <= start < end <= capacity for start, end in zip(starts, ends)):  # plain ints: a few rows
            _check_ranges(self.starts, self.ends, capacity)  # raises, naming them
        self.rows = (sum(ends) - sum(starts)) * kv_heads
        self.kernel = decode_kernel(self.rows)
        self.threads = kernel_threads() if threads is None else threads
        # (scaled queries, the scale asked, it in their dtype, zero): a buffer every layer's call rewrites
        self._prepared: tuple = (None, None, None, None)

    def _prepare(self, q: np.ndarray, scale: float | None) -> tuple:
        typed = typed_scale(scale, q.shape[-1], q.dtype)
        self._prepared = (np.empty(q.shape, dtype=q.dtype), scale, typed, q.dtype.type(0))
        return self._prepared

    def __call__(self, q: np.ndarray, k_blocks: np.ndarray | StoredCodes, v_blocks: np.ndarray | StoredCodes,
                 scale: float | None = None) -> np.ndarray:
        """One layer's attention [S, H_q, d] (its new K/V written already), as `paged_decode_attention`:
        `_decode` with the kernel chosen once and the queries scaled into a buffer every layer reuses (the
        kernel reads them during the call only; the output is a fresh array)."""
        scaled, asked, typed, zero = self._prepared
        if scaled is None or asked is not scale or scaled.dtype is not q.dtype or scaled.shape != q.shape:
            scaled, asked, typed, zero = self._prepare(q, scale)
        np.multiply(q, typed, out=scaled)  # `_scaled`'s product
        out = np.empty_like(scaled)
        kc, ks, kz, kind, group = kernel_operands(k_blocks)
        vc, vs, vz, value_kind, _ = kernel_operands(v_blocks)
        if value_kind != kind or (kc.dtype is not vc.dtype and kc.dtype != vc.dtype):
            raise ValueError("keys and values must be stored alike")
        self.kernel(scaled, kc, ks, kz, vc, vs, vz, kind, group, self.tables, self.starts, self.ends, SPAN,
                    self.threads, out, zero)
        return out


def decode_attention(q: np.ndarray, keys: np.ndarray | StoredCodes, values: np.ndarray | StoredCodes, start: int,
                     end: int, scale: float | None = None) -> np.ndarray:
    """Attention of one query per row, q [B, H_q, d], to a contiguous cache's keys/values
    [B, H_kv, capacity, d] (float rows or StoredCodes) rows start..end-1, read in place: pass the whole
    preallocated arrays. The contiguous layout is the paged one with one block per sequence."""
    batch, kv_heads, capacity, _ = _shape(keys)
    if not 0 <= start < end <= capacity:  # plain ints: this runs once per layer per decode step
        raise ValueError(f"every sequence needs a key range 0 <= start < end <= its capacity; got start "
                         f"{start}, end {end}, capacity {capacity}")
    starts, ends = np.full(batch, start, dtype=np.int64), np.full(batch, end, dtype=np.int64)
    q = _scaled(q, scale)
    out = np.empty_like(q)
    tables = np.arange(batch, dtype=np.int64)[:, None]
    _decode(q, keys, values, tables, starts, ends, out, rows=batch * kv_heads * (end - start),
            threads=kernel_threads())
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
