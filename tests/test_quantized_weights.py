"""Quantized weights kept as stored: GGUF blocks as codes/scales/offsets, and the kernels that read them.

Every block type's unpacking is held to llama.cpp's own decoder (`gguf.quants.dequantize`): the same
value for every weight. The compiled product is held to its NumPy twin (dequantize, then a float64
product) for every type, any number of rows of x (the kernel up to 16, tiles + BLAS above).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gguf_files import random_k_blocks
from kvlab.model.ggml_quants import BLOCK_SIZES, BLOCK_TYPES, dequantize, unpack
from kvlab.kernels import AVAILABLE
from kvlab.model.quantized import QuantizedMatrix

gguf = pytest.importorskip("gguf")
SIMPLE_TYPES = [t for t in BLOCK_TYPES if not t.endswith("_K")]


def file_blocks(type_name: str, rows: int, cols: int, rng: np.random.Generator, magnitude: float = 1.0):
    """Blocks as a file holds them: llama.cpp's encoder for the simple types, random bytes (valid scales)
    for the K types, which the gguf package cannot encode."""
    if type_name.endswith("_K"):
        return random_k_blocks(rows, cols, type_name, rng)
    weights = (magnitude * rng.standard_normal((rows, cols))).astype(np.float32)
    return gguf.quants.quantize(weights, gguf.GGMLQuantizationType[type_name])


@settings(max_examples=40, deadline=None)
@given(type_name=st.sampled_from(BLOCK_TYPES), rows=st.integers(1, 9), blocks=st.integers(1, 3),
       magnitude=st.sampled_from([1.0, 1e-6, 3e3]), seed=st.integers(0, 2**16))
def test_unpacked_blocks_dequantize_to_llama_cpps_values(type_name, rows, blocks, magnitude, seed):
    rng = np.random.default_rng(seed)
    cols = blocks * BLOCK_SIZES[type_name][0]
    raw = file_blocks(type_name, rows, cols, rng, magnitude)
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name]).reshape(rows, cols)
    got = dequantize(unpack(type_name, raw, (rows, cols)))
    assert got.dtype == np.float32 and got.shape == (rows, cols)
    assert np.array_equal(got, want)  # every value equal (a zero's sign may differ for Q4_0: d * 0)


def test_unpack_refuses_shapes_that_are_not_whole_blocks():
    raw = np.zeros((2, 34), dtype=np.uint8)
    with pytest.raises(ValueError, match="whole blocks of 32"):
        unpack("Q8_0", raw, (2, 48))
    with pytest.raises(ValueError, match="needs 4 blocks, got 2"):
        unpack("Q8_0", raw, (2, 64))
    with pytest.raises(ValueError, match="no block layout for IQ2_XS"):
        unpack("IQ2_XS", raw, (2, 32))


@pytest.mark.skipif(not AVAILABLE, reason="numba is not installed")
@settings(max_examples=40, deadline=None)
@given(type_name=st.sampled_from(BLOCK_TYPES), out=st.integers(1, 40), blocks=st.integers(1, 3),
       rows=st.integers(1, 20), seed=st.integers(0, 2**16))
def test_quantized_product_equals_dequantize_then_numpy(type_name, out, blocks, rows, seed):
    """x @ W.T from the codes (the compiled kernel for <= 16 rows of x, tiles + BLAS above) equals the
    product with the dequantized matrix, to float32 rounding of the sums."""
    rng = np.random.default_rng(seed)
    cols = blocks * BLOCK_SIZES[type_name][0]
    matrix = QuantizedMatrix.from_blocks(type_name, file_blocks(type_name, out, cols, rng), (out, cols))
    assert matrix.shape == (out, cols)
    weights = matrix.dequantize().astype(np.float64)
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    got = matrix.matmul_t(x)
    want = x.astype(np.float64) @ weights.T
    bound = 4e-7 * np.sqrt(cols) * (np.abs(x).astype(np.float64) @ np.abs(weights).T).max() + 1e-30
    assert got.dtype == np.float32 and got.shape == (rows, out)
    assert np.abs(got - want).max() <= bound
    reference = matrix.matmul_t(x, compiled=False)  # the NumPy twin: tiles of dequantized rows
    assert np.abs(reference - want).max() <= bound


def test_rows_concat_and_fingerprint():
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((6, 64)).astype(np.float32)
    matrix = QuantizedMatrix.quantize(weight, "Q4_1")
    assert matrix.nbytes == 6 * 64 * 0.75 and matrix.file_bytes == 6 * 64 * 20 // 32
    order = np.array([5, 0, 3, 1, 2, 4])
    assert np.array_equal(matrix.take_rows(order).dequantize(), matrix.dequantize()[order])
    other = QuantizedMatrix.quantize(weight[:2], "Q4_1")
    stacked = QuantizedMatrix.concat([matrix, other])
    assert np.array_equal(stacked.dequantize(), np.concatenate([matrix.dequantize(), other.dequantize()]))
    assert not QuantizedMatrix.can_concat([matrix, QuantizedMatrix.quantize(weight, "Q8_0")])
    with pytest.raises(ValueError, match="one quantization type"):
        QuantizedMatrix.concat([matrix, QuantizedMatrix.quantize(weight, "Q8_0")])
    assert matrix.fingerprint_bytes() == QuantizedMatrix.quantize(weight, "Q4_1").fingerprint_bytes()
    assert matrix.fingerprint_bytes() != matrix.take_rows(order).fingerprint_bytes()
