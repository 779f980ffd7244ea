"""The quantized kernels in their tiled layout (model/qtiles.py, kernels/qsimd.py, qgemv.py, qdecode_layer.py).

Each block type's compiled product is held to dequantize-then-NumPy (float64) within the summation-order
bound of float32 arithmetic, over shapes whose output rows are not a multiple of the 8-row tile, 1..16 rows
of x (the kernels' 4/3/2/1-row blocks) and extreme scales (float16's largest and subnormal values, mixed in
one matrix). The fused decode layer is held to the NumPy reference model of the same GGUF file.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gguf_files import assert_cached_logits_match, blocks, summation_bound
from kvlab.kernels import AVAILABLE
from kvlab.model.ggml_quants import BLOCK_SIZES, BLOCK_TYPES, dequantize, unpack
from kvlab.model.qtiles import LANES, from_tiles, gather_rows, to_tiles
from kvlab.model.quantized import QuantizedMatrix

gguf = pytest.importorskip("gguf")
needs_numba = pytest.mark.skipif(not AVAILABLE, reason="numba is not installed")

@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 40), groups=st.integers(1, 4), nibbles=st.booleans(), offsets=st.booleans(),
       seed=st.integers(0, 2**16))
def test_tiles_round_trip_and_gather(rows, groups, nibbles, offsets, seed):
    from kvlab.model.ggml_quants import Unpacked

    rng = np.random.default_rng(seed)
    width = groups * (16 if nibbles else 32)
    codes = rng.integers(0, 256, (rows, width), dtype=np.uint8)
    u = Unpacked(codes if nibbles else codes.view(np.int8), rng.random((rows, groups), dtype=np.float32),
                 rng.random((rows, groups), dtype=np.float32) if offsets else None, 32)
    tiles, tail = to_tiles(u)
    assert tiles.scales.shape == (rows // LANES, groups * LANES) and tail.scales.shape == (rows % LANES, groups)
    back = from_tiles(tiles, tail)
    index = rng.integers(0, rows, size=7)
    picked = gather_rows(tiles, tail, index)
    for name in ("codes", "scales", "offsets"):
        want = getattr(u, name)
        if want is None:
            assert getattr(back, name) is None and getattr(picked, name) is None
            continue
        assert np.array_equal(getattr(back, name), want) and getattr(back, name).dtype == want.dtype
        assert np.array_equal(getattr(picked, name), want[index])


@needs_numba
@settings(max_examples=60, deadline=None)
@given(type_name=st.sampled_from(BLOCK_TYPES), out=st.integers(1, 40), n_blocks=st.integers(1, 3),
       rows=st.integers(1, 20), scales=st.sampled_from(["normal", "max", "subnormal", "small", "mixed"]),
       seed=st.integers(0, 2**16))
def test_each_block_type_kernel_equals_dequantize_then_numpy(type_name, out, n_blocks, rows, scales, seed):
    """The tiled kernel (<= 16 rows of x) and the prefill bands (> 16: compiled dequantization of the
    tiles + BLAS) equal x @ dequantize(W).T within float32 summation error, elementwise; the compiled band
    dequantization equals the reference's bits."""
    from kvlab.kernels.qgemv import dequantize_tiles_t

    rng = np.random.default_rng(seed)
    cols = n_blocks * BLOCK_SIZES[type_name][0]
    raw = blocks(type_name, out, cols, rng, scales)
    matrix = QuantizedMatrix.from_blocks(type_name, raw, (out, cols))
    reference = dequantize(unpack(type_name, raw, (out, cols)))
    assert np.array_equal(matrix.dequantize(), reference)
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    got = matrix.matmul_t(x)
    want = x.astype(np.float64) @ reference.astype(np.float64).T
    assert got.dtype == np.float32 and got.shape == (rows, out)
    assert np.all(np.abs(got - want) <= summation_bound(x, reference))
    tiles = out // LANES
    for first in range(min(tiles, 2)):   # the whole band, and one starting past the first tile
        band_t = np.empty((cols, (tiles - first) * LANES), dtype=np.float32)
        dequantize_tiles_t(matrix.tiles, first, tiles, band_t)
        assert np.array_equal(band_t, reference[first * LANES:tiles * LANES].T)


@needs_numba
def test_inner_loop_is_eight_rows_in_a_vector_register():
    """The compiled product's assembly widens 8 codes per instruction into a ymm register and multiplies
    them in by FMA (lanes are rows): checked where the CPU has AVX2 + FMA (what LLVM targets there)."""
    from llvmlite import binding

    features = binding.get_host_cpu_features()
    if not (features.get("avx2") and features.get("fma")):
        pytest.skip("the CPU has no AVX2 + FMA")
    from numba import njit

    from kvlab.kernels.qgemv import NO_OFFSETS, group_sums, product_tile

    @njit  # not cached: numba inspects only code it compiled in this process
    def first_tile(x, xsum, codes, scales, offsets, group, out):
        product_tile(x, xsum, codes, scales, offsets, NO_OFFSETS, NO_OFFSETS, group, out, 0)

    rng = np.random.default_rng(0)
    for type_name, widen in (("Q8_0", "vpmovsxbd"), ("Q4_1", "vpmovzxbd")):
        tiles = QuantizedMatrix.quantize(rng.standard_normal((8, 64)).astype(np.float32), type_name).tiles
        x = rng.standard_normal((1, 64)).astype(np.float32)
        out = np.empty((1, 8), dtype=np.float32)
        offsets = NO_OFFSETS if tiles.offsets is None else tiles.offsets
        first_tile(x, group_sums(x, 32), tiles.codes, tiles.scales, offsets, 32, out)
        lines = "\n".join(first_tile.inspect_asm().values()).splitlines()
        for instruction in (widen, "vcvtdq2ps", "vfmadd231ps"):
            assert any(instruction in line and "ymm" in line for line in lines), (type_name, instruction)
        assert not any("vhaddps" in line or "vextractf128" in line for line in lines)  # no horizontal sums


# --- matrices of different types stacked by rows (a Q4_K_M layer's q/k/v) -------------------------------
if AVAILABLE:
    from kvlab.kernels import qdecode_layer

    stacked_runner = qdecode_layer._product  # one matrix or a stack, the branch the layer kernels take


@needs_numba
# (each case compiles its stack; the float layout's K-type stacks run through a model in
# test_quantized_weights.py's mixed-type file)
@pytest.mark.parametrize("activations, types", [("q8", ("Q4_K", "Q6_K")), ("q8", ("Q5_0", "Q8_0", "Q4_1")),
                                                ("float32", ("Q5_0", "Q8_0", "Q4_1"))])
@settings(max_examples=6, deadline=None)
@given(heights=st.lists(st.integers(1, 28), min_size=3, max_size=3), rows=st.integers(1, 16),
       seed=st.integers(0, 2**16))
def test_stacked_products_are_each_parts_product_in_its_columns(types, activations, heights, rows, seed):
    """The fused kernels' stack (q/k/v or gate/up of different types, kernels/qdecode_layer._stack_product) puts
    each part's product in its columns, bit for bit what that matrix gives alone: with int8 activations the
    model's own q8 product of it, in the float layout the same kernels run on that matrix alone (and near
    the dequantized float64 product); parts of any height, tails of fewer than eight rows included, one to
    sixteen rows of x (the fused calls' limit). (The q8 cases compile only their stack: a run of each part
    alone was one more kernel variant per type to compile, ~5 s each cold.)"""
    from kvlab.kernels.qgemv import dot_kernel_args, kernel_args

    rng = np.random.default_rng(seed)
    cols = 256  # whole K-type super-blocks
    parts = [QuantizedMatrix.from_blocks(t, blocks(t, h, cols, rng, "normal"), (h, cols))
             for t, h in zip(types, heights)]
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    args = tuple(dot_kernel_args(p.dot_layout, p.tail) if activations == "q8" else kernel_args(p.tiles, p.tail)
                 for p in parts)
    out = np.full((rows, sum(p.shape[0] for p in parts)), np.nan, dtype=np.float32)
    stacked_runner(x, args, out)
    if activations == "q8":
        alone = [p.matmul_t(x, True, "q8") for p in parts]
    else:
        alone = [np.full((rows, p.shape[0]), np.nan, dtype=np.float32) for p in parts]
        for w, o in zip(args, alone):
            stacked_runner(x, w, o)  # one matrix: the fused kernels' product of it alone
        exact = x.astype(np.float64) @ np.concatenate([p.dequantize(np.float64) for p in parts]).T
        bound = summation_bound(x, np.concatenate([p.dequantize() for p in parts]))
        assert np.all(np.abs(out - exact) <= bound)
    assert np.array_equal(out, np.concatenate(alone, axis=1))


# --- the fused decode layer, through a model ------------------------------------------------------------
@needs_numba
@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_1", "Q6_K"])
def test_fused_quantized_layers_give_the_dequantized_models_logits_and_tokens(tmp_path, type_name):
    """Every layer of a one-type file takes the fused kernels (int8 codes; nibbles with offsets; groups of
    16): logits within 1e-4 (max |logit| + 1) of the same file dequantized to float32 (NumPy reference),
    decoding through the cache too, and 64 greedy tokens equal."""
    import kvlab
    from gguf_files import small_config, write_gguf
    from kvlab.model.ops import QuantizedLayer

    path = tmp_path / "m.gguf"
    sizes = dict(hidden_size=256, intermediate_size=512) if type_name.endswith("_K") else {}
    write_gguf(path, small_config("llama", max_position_embeddings=128, **sizes), types=(type_name,))
    reference, tokenizer = kvlab.load(path, backend="numpy", weights_dtype="float32")
    assert not reference.quantized
    model, _ = kvlab.load(path, weights_dtype="stored", backend="numba", activations="float32")
    assert all(isinstance(layer, QuantizedLayer) for layer in model.ops.bind(model.layers))
    ids = assert_cached_logits_match(model, reference, tokenizer, prefill=3, greedy=64)
    batch = np.concatenate([ids, ids[:, ::-1]])  # two rows decoded together: the fused kernels' row blocks
    assert np.array_equal(kvlab.generate(model, batch, 8), kvlab.generate(reference, batch, 8))
