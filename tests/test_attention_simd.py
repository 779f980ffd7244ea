"""Decode attention's vector tile products (kernels/attention_simd.py) against NumPy, one call at a time:
the scores of eight keys at once with their transpose-and-add, the weighted sum of value rows held in
registers, and the int8 dequantization of a flat run; then the assembly, so that a fallback to the
numba loops (which would pass every equality test) is caught too."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab.kernels import AVAILABLE

pytestmark = pytest.mark.skipif(not AVAILABLE, reason="numba is not installed")

if AVAILABLE:
    from numba import njit

    from kvlab.kernels import attention
    from kvlab.kernels.attention_simd import dequantize_int4, dequantize_int8, simd_scores, simd_values, widen_run

    @njit
    def scores_call(q, first, out, col, rows, b, h, r0, n):
        simd_scores(q, first, out, col, rows, b, h, r0, n, attention._tile_scores, q.dtype.type(0))

    @njit
    def values_call(weights, col, rows, b, h, r0, n, acc):
        simd_values(weights, col, rows, b, h, r0, n, acc, attention._tile_values)

    @njit
    def dequantize_call(codes, scales, zeros, group, out):
        dequantize_int8(codes, scales, zeros, group, out, out.dtype.type(0))

    @njit
    def dequantize4_call(codes, scales, zeros, group, out):
        dequantize_int4(codes, scales, zeros, group, out, out.dtype.type(0))

    @njit
    def widen_call(src, out):
        widen_run(src, out, out.dtype.type(0))


@settings(max_examples=60, deadline=None)
@given(head_dim=st.sampled_from([8, 32, 64, 128]), heads=st.integers(1, 5), n=st.integers(1, 32),
       kv_heads=st.integers(1, 3), dtype=st.sampled_from(["float32", "float64"]), data=st.data(),
       seed=st.integers(0, 2**16))
def test_tile_scores_and_values_equal_numpy(head_dim, heads, n, kv_heads, dtype, data, seed):
    """Any tile length 1..32 (the last block of eight keys part-filled: its extra lanes repeat row n-1
    and are never read past the tile), any row offset in a [B, H, R, d] store, any head count, any
    column of the scores scratch; and a tile cut in two anywhere gives the same bits (what lets a
    span's result ignore block boundaries, kernels/attention.py)."""
    rng = np.random.default_rng(seed)
    rows_total = n + data.draw(st.integers(0, 40), label="rows before the tile")
    r0 = rows_total - n
    rows = rng.standard_normal((2, kv_heads, rows_total, head_dim)).astype(dtype)
    b, h = data.draw(st.integers(0, 1), label="b"), data.draw(st.integers(0, kv_heads - 1), label="h")
    first = data.draw(st.integers(0, 3), label="first head")
    q = rng.standard_normal((first + heads, head_dim)).astype(dtype)
    tile = rows[b, h, r0:r0 + n]

    col = data.draw(st.integers(0, 9), label="column")
    out = np.full((heads, col + 40), np.nan, dtype=dtype)
    scores_call(q, first, out, col, rows, b, h, r0, n)
    want = q[first:] @ tile.T
    tol = 1e-5 if dtype == "float32" else 1e-12
    assert np.abs(out[:, col:col + n] - want).max() <= tol * head_dim
    cut = data.draw(st.integers(1, n), label="cut")  # the first piece's length (n: one piece)
    pieces = np.full_like(out, np.nan)
    scores_call(q, first, pieces, col, rows, b, h, r0, cut)
    if cut < n:
        scores_call(q, first, pieces, col + cut, rows, b, h, r0 + cut, n - cut)
    assert np.array_equal(pieces[:, col:col + n], out[:, col:col + n])

    weights = rng.random((heads, col + 32)).astype(dtype)
    start = rng.standard_normal((heads, head_dim)).astype(dtype)
    acc = start.copy()
    want = acc + weights[:, col:col + n] @ tile
    values_call(weights, col, rows, b, h, r0, n, acc)
    assert np.abs(acc - want).max() <= tol * n
    split = start.copy()
    values_call(weights, col, rows, b, h, r0, cut, split)
    values_call(weights, col + cut, rows, b, h, r0 + cut, n - cut, split)
    assert np.array_equal(split, acc)


@settings(max_examples=60, deadline=None)
@given(bits=st.sampled_from([8, 4]), group=st.sampled_from([8, 16, 32, 64, 6]), groups=st.integers(1, 12),
       dtype=st.sampled_from(["float32", "float64"]), seed=st.integers(0, 2**16))
def test_int_runs_dequantize_as_numpy(bits, group, groups, dtype, seed):
    """zero_j + code * scale_j with each group's float16 scale and zero (bits as int16), extreme scales
    included; int4 codes two a byte, low nibble first. Groups not a multiple of 8 (16 for int4) take the
    loop."""
    rng = np.random.default_rng(seed)
    values = rng.integers(0, 2**bits, group * groups).astype(np.uint8)
    codes = values if bits == 8 else (values[0::2] | (values[1::2] << 4)).astype(np.uint8)
    scales = (rng.choice([1e-7, 1e-3, 1.0, 300.0], groups) * rng.random(groups)).astype(np.float16)
    zeros = (rng.standard_normal(groups) * 50).astype(np.float16)
    out = np.empty(group * groups, dtype=dtype)
    (dequantize_call if bits == 8 else dequantize4_call)(codes, scales.view(np.int16), zeros.view(np.int16),
                                                          group, out)
    want = (np.repeat(zeros.astype(np.float32), group) + values.astype(np.float32)
            * np.repeat(scales.astype(np.float32), group))
    assert np.abs(out - want).max() <= 1e-6 * (np.abs(want).max() + 1)


def test_the_float32_path_is_the_vector_code():
    """Where the CPU has AVX2 + FMA: the float32 scores compile to the unrolled ymm FMAs of head dims 32,
    64 and 128 (eight keys x (d/8 - 1) FMAs after a multiply: 200 in all; the numba loops the other head
    dims fall back to hold a dozen), so float32 tiles really take the vector code."""
    import re

    from llvmlite import binding

    features = binding.get_host_cpu_features()
    if not (features.get("avx2") and features.get("fma")):
        pytest.skip("the CPU has no AVX2 + FMA")
    args = (np.zeros((3, 64), np.float32), 0, np.zeros((3, 32), np.float32), 0,
            np.zeros((1, 1, 32, 64), np.float32), 0, 0, 0, 32)
    scores_call(*args)
    signature = next(sig for sig in scores_call.signatures if str(sig[0].dtype) == "float32")
    lines = scores_call.inspect_asm(signature).splitlines()
    assert sum(1 for line in lines if re.search(r"vfmadd\d+ps", line) and "ymm" in line) >= 200


@settings(max_examples=30, deadline=None)
@given(kind=st.sampled_from(["bfloat16", "float16"]), length=st.integers(1, 80), seed=st.integers(0, 2**16))
def test_half_runs_widen_exactly(kind, length, seed):
    """Every value of a flat run of float16/bfloat16 bits (subnormals, zeros of both signs, extremes
    included) comes out as its exact float32, vector code or loop (lengths not a multiple of 8)."""
    import ml_dtypes

    from kvlab.kernels.bits import as_kernel_array

    dtype = np.dtype(ml_dtypes.bfloat16) if kind == "bfloat16" else np.dtype(np.float16)
    bits = np.random.default_rng(seed).integers(0, 2**16, length).astype(np.uint16)
    bits[:4] = [0x0000, 0x8000, 0x0001, 0x7BFF if kind == "float16" else 0x7F7F][:min(4, length)]
    values = bits.view(dtype)
    finite = np.isfinite(values.astype(np.float32))
    values = np.where(finite, values, dtype.type(1.5))  # the caches hold finite values
    out = np.full(length, np.nan, np.float32)
    widen_call(as_kernel_array(values), out)
    assert np.array_equal(out, values.astype(np.float32))



def test_every_float16_widens_exactly_as_rows_and_as_scales():
    """Every finite float16 bit pattern: as a run of cache rows (exact float32 out) and as a group's
    scale and, shifted by one, its zero (one code a group of eight), against NumPy's widening."""
    halves = np.arange(2**16, dtype=np.uint16).view(np.float16)
    halves = halves[np.isfinite(halves)]
    halves = halves[: len(halves) // 8 * 8]
    out = np.full(len(halves), np.nan, np.float32)
    widen_call(halves.view(np.int16), out)
    assert np.array_equal(out, halves.astype(np.float32))
    codes = np.arange(len(halves) * 8, dtype=np.uint64).astype(np.uint8)
    zeros = np.roll(halves, 1)
    out = np.empty(len(halves) * 8, np.float32)
    dequantize_call(codes, halves.view(np.int16), zeros.view(np.int16), 8, out)
    want = np.repeat(zeros.astype(np.float32), 8) + codes.astype(np.float32) * np.repeat(halves.astype(np.float32), 8)
    assert np.allclose(out, want, rtol=1e-6, atol=0)
