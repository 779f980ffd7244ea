"""The compiled kernels against their NumPy twins, and the two backends of the model against each other.

Every fast path has a plain twin (ARCHITECTURE.md invariant 10): gemv over float32/float16/bfloat16 weights vs
`layers.linear`; decode attention over contiguous and paged caches of each dtype vs gather-then-softmax;
the whole model on `backend="numba"` vs `backend="numpy"` (hypothesis over configs, GQA ratios, windows,
batches, weight and cache dtypes). Errors are measured against float32 rounding, never assumed zero.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab import InputError, LlamaModel
from kvlab.config import ModelConfig
from kvlab.kernels import AVAILABLE, resolve_backend
from kvlab.model import layers

pytestmark = pytest.mark.skipif(not AVAILABLE, reason="numba is not installed")

if AVAILABLE:
    from kvlab.kernels import attention, gemv, prefill_attention
    from kvlab.kernels.bits import BFLOAT16

WEIGHT_DTYPES = ["float32", "float16", "bfloat16"]


def as_dtype(name: str) -> np.dtype:
    return BFLOAT16 if name == "bfloat16" else np.dtype(name)


def scale_of(*arrays: np.ndarray) -> float:
    return max(1.0, *(float(np.abs(a.astype(np.float64)).max()) for a in arrays))


# --- gemv ---------------------------------------------------------------------------------------------
@given(rows=st.integers(1, 20), out=st.integers(1, 70), depth=st.integers(1, 130),
       weight=st.sampled_from(WEIGHT_DTYPES), compute=st.sampled_from(["float32", "float64"]),
       bias=st.booleans(), seed=st.integers(0, 2**16))
def test_linear_equals_numpy_twin(rows, out, depth, weight, compute, bias, seed):
    """Rows 1..16 take the compiled kernel (blocks of four plus a remainder), more take BLAS."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, depth)).astype(compute)
    w = rng.standard_normal((out, depth)).astype(as_dtype(weight))
    b = rng.standard_normal(out).astype(compute) if bias else None
    got = gemv.linear(x, w, b)
    want = layers.linear(x, w) + (0 if b is None else b)
    assert got.dtype == np.dtype(compute) and got.shape == (rows, out)
    tol = (1e-12 if compute == "float64" else 2e-6) * depth * scale_of(x)
    assert np.abs(got - want).max() <= tol


@settings(max_examples=40)
@given(rows=st.integers(8, 16), out=st.integers(60, 300), depth=st.integers(1, 200),
       weight=st.sampled_from(WEIGHT_DTYPES), compute=st.sampled_from(["float32", "float64"]),
       seed=st.integers(0, 2**16))
def test_tiled_products_equal_numpy_twin(rows, out, depth, weight, compute, seed):
    """From TILE_MIN_ROWS rows, L2-sized column blocks with rows four, two and one at a time (several
    columns per block here, 1-3 rows past the last block of four, depths that are no multiple of a vector)."""
    assert gemv.TILE_MIN_ROWS <= rows <= gemv.MAX_KERNEL_ROWS
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, depth)).astype(compute)
    w = rng.standard_normal((out, depth)).astype(as_dtype(weight))
    got = gemv.linear(x, w)
    want = layers.linear(x, w)
    tol = (1e-12 if compute == "float64" else 2e-6) * depth * scale_of(x)
    assert np.abs(got - want).max() <= tol


def test_linear_widens_half_precision_exactly():
    """Each bfloat16/float16 element (normal, subnormal, signed zero, extremes) widens to its exact value."""
    x = np.eye(4, dtype=np.float32)[:1]  # picks column 0 of w.T: out[n] = w[n, 0] exactly
    for dtype in (BFLOAT16, np.float16):
        info = ml_dtypes.finfo(dtype)
        values = np.array([0.0, -0.0, 1.0, -2.5, float(info.max), -float(info.max), float(info.tiny),
                           float(info.smallest_subnormal), -float(info.smallest_subnormal), 3.14159],
                          dtype=np.float32).astype(dtype)
        w = np.zeros((values.size, 4), dtype=dtype)
        w[:, 0] = values
        np.testing.assert_array_equal(gemv.linear(x, w)[0], values.astype(np.float32))
        widened = gemv.widen_matrix(w, np.dtype(np.float32))  # bit for bit, -0 included
        np.testing.assert_array_equal(widened.view(np.uint32), w.astype(np.float32).view(np.uint32))


@given(rows=st.integers(1, 6), inter=st.integers(1, 40), hidden=st.integers(1, 40),
       weight=st.sampled_from(WEIGHT_DTYPES), seed=st.integers(0, 2**16))
def test_fused_norm_and_swiglu_products_equal_their_twins(rows, inter, hidden, weight, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, rows, hidden)).astype(np.float32) * 3
    norm = (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32)
    w_up = rng.standard_normal((2 * inter, hidden)).astype(as_dtype(weight))
    w_down = rng.standard_normal((hidden, inter)).astype(as_dtype(weight))
    gate_up = gemv.norm_linear(x, norm, 1e-5, w_up)
    want = layers.linear(layers.rms_norm(x, norm, 1e-5), w_up)
    assert gate_up.shape == want.shape
    assert np.abs(gate_up - want).max() <= 1e-5 * hidden * scale_of(want)
    gate_up[..., 0] = -200.0  # exp(-gate) overflows: silu must give -0, not nan
    with np.errstate(over="ignore"):
        want_down = layers.linear(layers.swiglu(gate_up[..., :inter], gate_up[..., inter:]), w_down)
    got_down = gemv.swiglu_linear(gate_up, w_down)
    assert np.isfinite(got_down).all()
    assert np.abs(got_down - want_down).max() <= 1e-5 * inter * scale_of(want_down)


@given(rows=st.integers(1, 12), inter=st.integers(1, 70), seed=st.integers(0, 2**16),
       dtype=st.sampled_from([np.float32, np.float64]))
def test_swiglu_rows_over_the_threads_have_the_serial_bits(rows, inter, seed, dtype):
    """A batch's or a prefill's rows go over the threads (gemv.swiglu_batch), a decode step's row stays on
    the calling thread: each row's bits must not depend on which, nor on the error model that lets the
    division vectorise (gates that overflow exp, and infinities, included)."""
    rng = np.random.default_rng(seed)
    gate_up = (rng.standard_normal((rows, 2 * inter)) * 30).astype(dtype)
    gate_up[0, 0], gate_up[-1, inter - 1] = -200.0, np.inf
    serial, parallel, batched = (np.empty((rows, inter), dtype=dtype) for _ in range(3))
    with np.errstate(over="ignore", invalid="ignore"):
        gemv._swiglu_serial(gate_up, serial)
        gemv._swiglu_parallel(gate_up, parallel)
        gemv.swiglu_batch(gate_up, batched)
        want = layers.swiglu(gate_up[:, :inter].astype(np.float64), gate_up[:, inter:].astype(np.float64))
    assert np.array_equal(serial.view(np.uint8), parallel.view(np.uint8))
    assert np.array_equal(serial.view(np.uint8), batched.view(np.uint8))
    finite = np.isfinite(want)
    assert np.allclose(serial[finite], want[finite], rtol=1e-5, atol=1e-30)


# --- decode attention ---------------------------------------------------------------------------------
@contextlib.contextmanager
def threshold(rows: int):
    """Force the parallel (0) or the single-threaded (huge) attention kernel, whatever the size."""
    saved = attention.PARALLEL_MIN_ROWS
    attention.PARALLEL_MIN_ROWS = rows
    try:
        yield
    finally:
        attention.PARALLEL_MIN_ROWS = saved


@given(batch=st.integers(1, 3), kv_heads=st.integers(1, 3), group=st.integers(1, 4),
       head_dim=st.sampled_from([2, 8, 64, 128]), length=st.integers(1, 200), data=st.data(),
       cache=st.sampled_from(WEIGHT_DTYPES), parallel=st.booleans(), seed=st.integers(0, 2**16))
def test_contiguous_decode_attention_equals_twin(batch, kv_heads, group, head_dim, length, data, cache, parallel,
                                                 seed):
    rng = np.random.default_rng(seed)
    start = data.draw(st.integers(0, length - 1), label="start (window)")
    capacity = length + data.draw(st.integers(0, 9), label="spare capacity")
    # small magnitudes put float16 rows among its subnormals (below 6.1e-5), which widen exactly too
    magnitude = data.draw(st.sampled_from([1.0, 1e-3, 1e-6]), label="value magnitude")
    keys = (2 * rng.standard_normal((batch, kv_heads, capacity, head_dim))).astype(as_dtype(cache))
    values = (magnitude * rng.standard_normal((batch, kv_heads, capacity, head_dim))).astype(as_dtype(cache))
    q = (2 * rng.standard_normal((batch, kv_heads * group, head_dim))).astype(np.float32)
    with threshold(0 if parallel else 10**9):
        got = attention.decode_attention(q, keys, values, start, length)
    want = attention.decode_attention_reference(q, keys, values, start, length)
    assert np.abs(got - want).max() <= 2e-6 * head_dim * magnitude


@pytest.mark.parametrize("dtype", [np.float16, BFLOAT16])
def test_decode_attention_reads_every_half_precision_bit_pattern_exactly(dtype):
    """One key per sequence: the softmax weight is exactly 1, so the output must be the stored value row
    widened exactly, for every finite float16/bfloat16 bit pattern (normals, subnormals, signed zeros)."""
    bits = np.arange(1 << 16, dtype=np.uint16).view(dtype)
    bits = bits[np.isfinite(bits.astype(np.float32))]
    head_dim = 64
    rows = -(-bits.size // head_dim)
    values = np.zeros(rows * head_dim, dtype=dtype)
    values[:bits.size] = bits
    values = values.reshape(rows, 1, 1, head_dim)
    keys = np.ones_like(values)
    q = np.ones((rows, 2, head_dim), dtype=np.float32)  # two query heads share the KV head (GQA)
    got = attention.decode_attention(q, keys, values, 0, 1)
    want = values.astype(np.float32).reshape(rows, 1, head_dim)
    assert np.array_equal(got[:, 0], want[:, 0]) and np.array_equal(got[:, 1], want[:, 0])


@given(num_seqs=st.integers(1, 4), kv_heads=st.integers(1, 3), group=st.integers(1, 3),
       block_size=st.sampled_from([1, 4, 16, 32]), cache=st.sampled_from(WEIGHT_DTYPES), data=st.data(),
       parallel=st.booleans(), seed=st.integers(0, 2**16))
def test_paged_decode_attention_equals_twin_and_contiguous(num_seqs, kv_heads, group, block_size, cache, data,
                                                           parallel, seed):
    """Keys in shuffled blocks through block tables give what the same keys give laid out contiguously."""
    rng = np.random.default_rng(seed)
    head_dim = 16
    lens = data.draw(st.lists(st.integers(1, 150), min_size=num_seqs, max_size=num_seqs), label="lengths")
    starts = [data.draw(st.integers(0, n - 1), label="start") for n in lens]
    max_blocks = max(-(-n // block_size) for n in lens)
    num_blocks = num_seqs * max_blocks + 3
    order = rng.permutation(num_blocks)  # a block pool handed out in no particular order
    tables = np.full((num_seqs, max_blocks), -1, dtype=np.int32)
    k_blocks = rng.standard_normal((num_blocks, kv_heads, block_size, head_dim)).astype(as_dtype(cache))
    v_blocks = rng.standard_normal((num_blocks, kv_heads, block_size, head_dim)).astype(as_dtype(cache))
    used = 0
    for s, n in enumerate(lens):
        count = -(-n // block_size)
        tables[s, :count] = order[used:used + count]
        used += count
    q = rng.standard_normal((num_seqs, kv_heads * group, head_dim)).astype(np.float32)
    with threshold(0 if parallel else 10**9):
        got = attention.paged_decode_attention(q, k_blocks, v_blocks, tables, lens, starts)
    want = attention.paged_decode_attention_reference(q, k_blocks, v_blocks, tables, lens, starts)
    assert np.abs(got - want).max() <= 2e-6 * head_dim
    for s, n in enumerate(lens):  # the contiguous kernel on the gathered rows
        blocks = tables[s, :-(-n // block_size)]
        keys = np.concatenate(list(k_blocks[blocks]), axis=1)[None]
        values = np.concatenate(list(v_blocks[blocks]), axis=1)[None]
        alone = attention.decode_attention(q[s:s + 1], keys, values, starts[s], n)[0]
        assert np.abs(alone - got[s]).max() <= 2e-6 * head_dim


def test_paged_attention_refuses_bad_ranges():
    q = np.zeros((1, 2, 4), np.float32)
    blocks = np.zeros((2, 1, 4, 4), np.float32)
    with pytest.raises(ValueError, match="key range"):
        attention.paged_decode_attention(q, blocks, blocks, np.array([[0, 1]]), [9])
    with pytest.raises(ValueError, match="key range"):
        attention.paged_decode_attention(q, blocks, blocks, np.array([[0, 1]]), [3], [3])


# --- prefill attention ----------------------------------------------------------------------------------
@given(batch=st.integers(1, 3), kv_heads=st.integers(1, 3), group=st.integers(1, 4),
       head_dim=st.sampled_from([2, 8, 64, 128]), num_new=st.integers(1, 90), cached=st.integers(0, 70),
       window=st.one_of(st.none(), st.integers(1, 40)), causal=st.booleans(),
       cache=st.sampled_from(WEIGHT_DTYPES), compute=st.sampled_from(["float32", "float64"]),
       spare=st.integers(0, 5), seed=st.integers(0, 2**16))
def test_prefill_attention_equals_numpy_attend(batch, kv_heads, group, head_dim, num_new, cached, window, causal,
                                               cache, compute, spare, seed):
    """New queries after `cached` rows, causal or not, windowed or not, any cache dtype, read in place from
    storage with spare rows past the end: what `layers.attend` gives on the widened rows."""
    rng = np.random.default_rng(seed)
    total = cached + num_new
    keys = (2 * rng.standard_normal((batch, kv_heads, total + spare, head_dim))).astype(as_dtype(cache))
    values = rng.standard_normal((batch, kv_heads, total + spare, head_dim)).astype(as_dtype(cache))
    q = (2 * rng.standard_normal((batch, kv_heads * group, num_new, head_dim))).astype(compute)
    mask = layers.attention_mask(np.arange(cached, total), np.arange(total), causal=causal, sliding_window=window)
    ranges = prefill_attention.key_ranges(mask, batch, num_new, total)
    assert ranges is not None  # causal masks and windows give one run of keys per row
    got = prefill_attention.prefill_attention(q, keys, values, *ranges)
    want = layers.attend(q, keys[:, :, :total].astype(compute), values[:, :, :total].astype(compute), mask)
    assert got.dtype == np.dtype(compute) and got.shape == want.shape
    tol = 1e-13 if compute == "float64" else 2e-6
    assert np.abs(got - want).max() <= tol * head_dim * scale_of(want)


@given(num_seqs=st.integers(1, 3), block_size=st.sampled_from([1, 4, 16]), cache=st.sampled_from(WEIGHT_DTYPES),
       data=st.data(), seed=st.integers(0, 2**16))
def test_paged_prefill_attention_equals_contiguous(num_seqs, block_size, cache, data, seed):
    """Chunks of new queries per sequence over keys in shuffled blocks (an engine's chunked prefill):
    the same as the contiguous kernel on the gathered rows, sequence by sequence."""
    rng = np.random.default_rng(seed)
    kv_heads, group, head_dim = 2, 2, 8
    num_new = data.draw(st.integers(1, 20), label="new tokens per sequence")
    cached = data.draw(st.lists(st.integers(0, 40), min_size=num_seqs, max_size=num_seqs), label="cached")
    lens = [c + num_new for c in cached]
    max_blocks = max(-(-n // block_size) for n in lens)
    num_blocks = num_seqs * max_blocks + 2
    order = rng.permutation(num_blocks)
    tables = np.zeros((num_seqs, max_blocks), dtype=np.int64)
    k_blocks = rng.standard_normal((num_blocks, kv_heads, block_size, head_dim)).astype(as_dtype(cache))
    v_blocks = rng.standard_normal((num_blocks, kv_heads, block_size, head_dim)).astype(as_dtype(cache))
    lo = np.zeros((num_seqs, num_new), dtype=np.int64)
    hi = np.array([[c + i + 1 for i in range(num_new)] for c in cached])
    for s, n in enumerate(lens):
        count = -(-n // block_size)
        tables[s, :count] = order[s * max_blocks:s * max_blocks + count]
    q = rng.standard_normal((num_seqs, kv_heads * group, num_new, head_dim)).astype(np.float32)
    got = prefill_attention.paged_prefill_attention(q, k_blocks, v_blocks, tables, lo, hi)
    for s, n in enumerate(lens):
        blocks = tables[s, :-(-n // block_size)]
        keys = np.concatenate(list(k_blocks[blocks]), axis=1)[None]
        values = np.concatenate(list(v_blocks[blocks]), axis=1)[None]
        alone = prefill_attention.prefill_attention(q[s:s + 1], keys, values, lo[s:s + 1], hi[s:s + 1])[0]
        assert np.abs(alone - got[s]).max() <= 2e-6 * head_dim


@given(kv_heads=st.integers(1, 3), group=st.integers(1, 3), head_dim=st.sampled_from([8, 64, 128]),
       block_size=st.sampled_from([1, 4, 16]), cache=st.sampled_from(WEIGHT_DTYPES),
       window=st.one_of(st.none(), st.integers(1, 30)), causal=st.booleans(), data=st.data(),
       seed=st.integers(0, 2**16))
def test_varlen_prefill_attention_equals_numpy_attend_per_sequence(kv_heads, group, head_dim, block_size, cache,
                                                                   window, causal, data, seed):
    """Several sequences' chunks in one call, each its own length (crossing query tiles) and cached prefix,
    keys in shuffled blocks: each sequence's rows equal `layers.attend` on its own widened keys."""
    rng = np.random.default_rng(seed)
    new = data.draw(st.lists(st.integers(1, 45), min_size=1, max_size=5), label="chunk lengths")
    cached = data.draw(st.lists(st.integers(0, 50), min_size=len(new), max_size=len(new)), label="cached")
    lens = [c + n for c, n in zip(cached, new)]
    counts = [-(-n // block_size) for n in lens]
    num_blocks = sum(counts) + 3
    order = rng.permutation(num_blocks)
    tables = np.zeros((len(new), max(counts)), dtype=np.int64)
    for s, count in enumerate(counts):
        tables[s, :count] = order[sum(counts[:s]):sum(counts[:s]) + count]
    shape = (num_blocks, kv_heads, block_size, head_dim)
    k_blocks = (2 * rng.standard_normal(shape)).astype(as_dtype(cache))
    v_blocks = rng.standard_normal(shape).astype(as_dtype(cache))
    q = (2 * rng.standard_normal((sum(new), kv_heads * group, head_dim))).astype(np.float32)
    starts = np.concatenate([[0], np.cumsum(new)])
    masks = [layers.attention_mask(np.arange(c, c + n), np.arange(c + n), causal=causal, sliding_window=window)
             for c, n in zip(cached, new)]
    ranges = [prefill_attention.key_ranges(m, 1, n, c + n) for m, c, n in zip(masks, cached, new)]
    lo = np.concatenate([r[0][0] for r in ranges])
    hi = np.concatenate([r[1][0] for r in ranges])
    got = prefill_attention.varlen_prefill_attention(q, k_blocks, v_blocks, tables, starts, lo, hi)
    assert got.shape == q.shape and got.dtype == q.dtype
    for s, (c, n) in enumerate(zip(cached, new)):
        blocks = tables[s, :counts[s]]
        keys = np.concatenate(list(k_blocks[blocks]), axis=1)[None, :, :c + n].astype(np.float32)
        values = np.concatenate(list(v_blocks[blocks]), axis=1)[None, :, :c + n].astype(np.float32)
        mine = q[starts[s]:starts[s + 1]].transpose(1, 0, 2)[None]
        want = layers.attend(mine, keys, values, masks[s])[0].transpose(1, 0, 2)
        assert np.abs(got[starts[s]:starts[s + 1]] - want).max() <= 2e-6 * head_dim * scale_of(want)


def test_varlen_prefill_attention_refuses_bad_offsets():
    """query_starts that do not cover the rows, or ranges past the block tables: a ValueError naming them."""
    q = np.zeros((5, 2, 4), dtype=np.float32)
    kv = np.zeros((2, 1, 4, 4), dtype=np.float32)
    tables = np.array([[0], [1]])
    ok = np.zeros(5, dtype=np.int64), np.ones(5, dtype=np.int64)
    for starts, (lo, hi) in [([0, 2, 4], ok), ([0, 3, 2, 5][:3], ok), ([0, 2, 5], (ok[0], np.full(5, 5)))]:
        with pytest.raises(ValueError, match="query_starts"):
            prefill_attention.varlen_prefill_attention(q, kv, kv, tables, np.array(starts), lo, hi)
    assert prefill_attention.varlen_prefill_attention(q, kv, kv, tables, np.array([0, 2, 5]), *ok).shape == q.shape


def test_key_ranges_from_masks():
    """A mask whose visible keys are one run per row gives lo/hi; any other mask gives None (the model then
    takes the NumPy path); a row that sees nothing gives an empty range and zeros."""
    causal = layers.attention_mask(np.arange(3, 6), np.arange(6), causal=True)
    lo, hi = prefill_attention.key_ranges(causal, 2, 3, 6)
    np.testing.assert_array_equal(lo, np.zeros((2, 3)))
    np.testing.assert_array_equal(hi, [[4, 5, 6]] * 2)
    holes = np.ones((3, 6), dtype=bool)
    holes[1, 2] = False
    assert prefill_attention.key_ranges(holes, 1, 3, 6) is None
    empty = np.zeros((1, 2, 4), dtype=bool)
    empty[0, 1, 1:3] = True
    lo, hi = prefill_attention.key_ranges(empty, 1, 2, 4)
    assert (lo[0, 0], hi[0, 0]) == (0, 0) and (lo[0, 1], hi[0, 1]) == (1, 3)
    q = np.ones((1, 1, 2, 4), np.float32)
    kv = np.ones((1, 1, 4, 4), np.float32)
    out = prefill_attention.prefill_attention(q, kv, kv, lo, hi)
    assert np.all(out[0, 0, 0] == 0) and np.allclose(out[0, 0, 1], 1)
    assert prefill_attention.key_ranges(None, 1, 2, 5)[1].tolist() == [[5, 5]]


def test_fast_exp_within_two_ulp_of_exp():
    """The vectorised float32 exp (softmax, SiLU) against float64 exp over float32's range, and its ends."""
    from numba import njit

    from kvlab.kernels.fastexp import fast_exp

    @njit
    def apply(x, out):
        for i in range(x.shape[0]):
            out[i] = fast_exp(x[i])

    x = np.concatenate([np.linspace(-87.3, 88.3, 400_001, dtype=np.float32),
                        np.float32([0.0, -0.0, 1e-8, -1e-8])])
    got = np.empty_like(x)
    apply(x, got)
    want = np.exp(x.astype(np.float64))
    rel = np.abs(got - want) / want
    assert rel.max() <= 2 * np.finfo(np.float32).eps
    ends = np.float32([np.inf, 100.0, 88.5, -88.0, -1000.0, -np.inf])
    out = np.empty_like(ends)
    apply(ends, out)
    assert out.tolist() == [np.inf, np.inf, np.inf, 0.0, 0.0, 0.0]
    x64, out64 = np.array([-700.0, 0.5, 700.0]), np.empty(3)
    apply(x64, out64)  # float64 kernels keep np.exp
    np.testing.assert_array_equal(out64, np.exp(x64))


def test_fast_exp_compiles_without_numba_asking_to_report_a_bug():
    """A cold compile of a softmax-shaped loop around fast_exp raises no NumbaIRAssumptionWarning: its
    text ("This warning came from an internal pedantic check. Please report ...") was printed on the
    first `kvlab generate` of a fresh install, under the main job's output."""
    import warnings

    from numba import njit
    from numba.core.errors import NumbaIRAssumptionWarning

    from kvlab.kernels.fastexp import fast_exp

    @njit(fastmath={"reassoc", "contract"})  # not cached: compiled here, now
    def softmax_numerator(x, out):
        top = x[0]
        for i in range(x.shape[0]):
            top = max(top, x[i])
        for i in range(x.shape[0]):
            out[i] = fast_exp(x[i] - top)
        return fast_exp(top - x[1])

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        x = np.float32([0.0, 1.0, -2.0, 3.0])
        out = np.empty_like(x)
        softmax_numerator(x, out)
    assert not [w for w in caught if issubclass(w.category, NumbaIRAssumptionWarning)]
    np.testing.assert_allclose(out, np.exp(x - 3.0), rtol=1e-6)


# --- the model's two backends -------------------------------------------------------------------------
CONFIGS = {
    "gqa": {},
    "mqa": {"num_key_value_heads": 1},
    "mha": {"num_key_value_heads": 4},
    "bias": {"architecture": "Qwen2ForCausalLM", "attention_bias": True},
    "window": {"architecture": "MistralForCausalLM", "sliding_window": 4},
    "tied": {"tie_word_embeddings": True},
}


def model_pair(changes: dict, dtype, weights_dtype=None, seed: int = 3) -> tuple[LlamaModel, LlamaModel]:
    base = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64)
    config = ModelConfig(**{**base, **changes})
    from kvlab.model.weights import random_weights
    weights = random_weights(config, seed, np.float64)
    return tuple(LlamaModel(config, weights, dtype=dtype, weights_dtype=weights_dtype, backend=backend)
                 for backend in ("numba", "numpy"))


def run_schedule(model: LlamaModel, ids: np.ndarray, prefill: int, kv_dtype) -> np.ndarray:
    cache = model.new_cache(ids.shape[0], kv_dtype=kv_dtype)
    out = [model.forward(ids[:, :prefill], cache=cache).logits]
    out += [model.forward(ids[:, i:i + 1], cache=cache).logits for i in range(prefill, ids.shape[1])]
    return np.concatenate(out, axis=1)


@settings(max_examples=20)
@given(name=st.sampled_from(list(CONFIGS)), batch=st.integers(1, 5), prefill=st.integers(1, 12),
       weights=st.sampled_from(["float32", "bfloat16", "float16"]),
       kv_dtype=st.sampled_from([None, "float16", "bfloat16"]), seed=st.integers(0, 2**16))
def test_compiled_backend_equals_numpy_backend(name, batch, prefill, weights, kv_dtype, seed):
    """Prefill then decode steps (the compiled decode attention reads the cache in place): the same logits
    as the NumPy reference, to float32 rounding, whatever the weights and the cache are stored in."""
    compiled, reference = model_pair(CONFIGS[name], np.float32, weights)
    assert compiled.weights_dtype == reference.weights_dtype == as_dtype(weights)
    assert compiled.layers[0].w_qkv.dtype == as_dtype(weights)
    ids = np.random.default_rng(seed).integers(0, 97, size=(batch, prefill + 6))
    got = run_schedule(compiled, ids, prefill, kv_dtype)
    want = run_schedule(reference, ids, prefill, kv_dtype)
    # A half-precision cache rounds each new K/V value: a float32-level difference upstream (another
    # summation order) can tip a rounding by one unit of the cache's precision, 2^-8 for bfloat16, and that
    # step then reaches the logits. Measured worst: 1.2e-4 x scale (bfloat16 cache, float16 weights).
    cache_eps = 0.0 if kv_dtype is None else float(ml_dtypes.finfo(as_dtype(kv_dtype)).eps)
    assert np.abs(got - want).max() <= max(1e-4, cache_eps / 4) * scale_of(want)


@settings(max_examples=8)
@given(name=st.sampled_from(list(CONFIGS)), batch=st.integers(8, 16),
       weights=st.sampled_from(["float32", "bfloat16", "float16"]), seed=st.integers(0, 2**16))
def test_batched_decode_in_register_tiles_equals_numpy_backend(name, batch, weights, seed):
    """Batches of 8-16 rows decode through the fused block kernels' column blocks: the same logits as the
    NumPy reference, to float32 rounding."""
    compiled, reference = model_pair(CONFIGS[name], np.float32, weights)
    ids = np.random.default_rng(seed).integers(0, 97, size=(batch, 7))
    got, want = run_schedule(compiled, ids, 3, None), run_schedule(reference, ids, 3, None)
    assert np.abs(got - want).max() <= 1e-4 * scale_of(want)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_compiled_backend_equals_numpy_backend_in_float64(name):
    compiled, reference = model_pair(CONFIGS[name], np.float64)
    ids = np.random.default_rng(0).integers(0, 97, size=(2, 14))
    for kv_dtype in (None, "float32"):
        got, want = run_schedule(compiled, ids, 5, kv_dtype), run_schedule(reference, ids, 5, kv_dtype)
        assert np.abs(got - want).max() <= 1e-10
    full = reference.forward(ids).logits  # and both equal a full recompute
    assert np.abs(run_schedule(compiled, ids, 5, None) - full).max() <= 1e-10


def test_bfloat16_weights_compute_what_float32_computes_on_the_same_values():
    """Keeping bfloat16 matrices as stored is exact: it equals a float32 model of the widened values."""
    half, _ = model_pair({}, np.float32, "bfloat16")
    from kvlab.model.weights import random_weights
    widened = {k: (v.astype(BFLOAT16).astype(np.float32) if v.ndim == 2 else v)
               for k, v in random_weights(half.config, 3, np.float64).items()}
    full = LlamaModel(half.config, widened, dtype=np.float32)
    assert full.weights_dtype == np.float32 and half.layers[0].w_down.dtype == BFLOAT16
    assert half.layers[0].w_down.nbytes * 2 == full.layers[0].w_down.nbytes
    ids = np.arange(1, 13)[None]
    assert np.abs(run_schedule(half, ids, 6, None) - run_schedule(full, ids, 6, None)).max() <= 1e-4
    assert half.fingerprint != full.fingerprint  # cached K/V name the weights they came from


def test_backend_and_weights_dtype_errors(monkeypatch):
    config = ModelConfig(vocab_size=11, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
    with pytest.raises(InputError, match="unknown backend 'cuda'"):
        LlamaModel(config, backend="cuda")
    from kvlab.errors import CheckpointError
    with pytest.raises(CheckpointError, match="weights_dtype must be"):
        LlamaModel(config, weights_dtype="int8")
    with pytest.raises(CheckpointError, match="need float32 compute"):
        LlamaModel(config, dtype=np.float64, weights_dtype="bfloat16")
    monkeypatch.setenv("KVLAB_BACKEND", "numpy")
    assert resolve_backend(None) == "numpy" and LlamaModel(config).backend == "numpy"
    assert resolve_backend("numba") == "numba"


def test_numpy_fallback_when_numba_cannot_be_imported():
    """A machine without numba still runs: the model takes the NumPy path and says why."""
    code = ("import sys; sys.modules['numba'] = None\n"
            "import numpy as np, kvlab, kvlab.kernels as k\n"
            "m = kvlab.TinyLlama(seed=7)\n"
            "assert not k.AVAILABLE and 'numba' in k.UNAVAILABLE_REASON and m.backend == 'numpy'\n"
            "cache = m.new_cache()\n"
            "m.forward(np.array([[1, 2, 3]]), cache=cache); m.forward(np.array([[4]]), cache=cache)\n"
            "print('numpy-ok')")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "numpy-ok" in result.stdout


@pytest.mark.parametrize("backend", ["numba", "numpy"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_verify_covers_both_backends(capsys, backend, dtype):
    import json

    from kvlab.cli import main
    assert main(["verify", "--backend", backend, "--dtype", dtype, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] and report["model"].endswith(f"{backend} backend")
    assert max(c["max_abs_error"] for c in report["checks"]) <= (1e-10 if dtype == "float64" else 1e-4)


def test_load_weights_dtype_choices():
    """The shipped float32 model: "auto" keeps float32; "bfloat16" rounds on request; nonsense is refused."""
    import kvlab
    from kvlab.errors import ConfigError
    model, _ = kvlab.load()
    assert model.weights_dtype == np.float32
    half, _ = kvlab.load(weights_dtype="bfloat16")
    assert half.weights_dtype == BFLOAT16 and half.lm_head.dtype == BFLOAT16
    ids = np.arange(1, 9)[None]
    err = np.abs(half.forward(ids).logits - model.forward(ids).logits).max()
    assert 0 < err < 0.5  # rounding the weights is a real (small) change: measured, not assumed zero
    with pytest.raises(ConfigError, match="weights_dtype must be"):
        kvlab.load(weights_dtype="int8")


def test_warm_up_compiles_before_timing_and_changes_nothing():
    """`warm_up` runs a throwaway prefill and decode (the first run's compile lands there, reported on the
    stats line, not in the prefill figure); the model's outputs are the same after it."""
    from kvlab.cli.generate import GenerationStats

    model, _ = model_pair({}, np.float32)
    ids = np.array([[5, 9, 2, 7]])
    before = model.forward(ids).logits
    assert model.warm_up() >= 0.0 and model.warm_up("bfloat16") >= 0.0
    np.testing.assert_array_equal(model.forward(ids).logits, before)
    stats = GenerationStats(3, 3, 0.01, 5, 0.02, 8, 64, "float32", "max tokens", compile_seconds=47.9)
    assert stats.line().endswith("| kernels compiled 47.9 s (first run; cached on disk)")
    stats.compile_seconds = 0.0  # a warm start (numba compiled nothing, however long loading took): no report
    assert "kernels" not in stats.line()
