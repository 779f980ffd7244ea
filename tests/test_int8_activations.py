"""`activations="q8"`: the inputs of quantized products rounded to int8 per group, integer dot products.

The rounding (model/act_quant.py) is held to its definition; its compiled twin to its bits; the integer
kernels (kernels/qdot.py, with VNNI and through the generic IR) and the prefill path to `rounded(x) @
dequantize(W).T` within float32 summation error for every block type; a model in the mode to the NumPy
reference model in the same mode; and the mode is refused where it means nothing, and keeps its caches
apart from the exact model's.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from gguf_files import blocks, same_in_every_layer
from kvlab.errors import CacheMismatchError, InputError
from kvlab.kernels import AVAILABLE
from kvlab.model.act_quant import round_activations, rounded
from kvlab.model.ggml_quants import BLOCK_SIZES, BLOCK_TYPES, Unpacked, dequantize, unpack
from kvlab.model.qtiles import LANES, from_dot_codes, gather_dot_codes, to_dot_codes, to_dot_codes5, to_dot_codes6
from kvlab.model.quantized import QuantizedMatrix

gguf = pytest.importorskip("gguf")
needs_numba = pytest.mark.skipif(not AVAILABLE, reason="numba is not installed")
U = 2.0 ** -24

finite_floats = st.floats(-2.0 ** 100, 2.0 ** 100, width=32, allow_subnormal=True)
any_floats = st.one_of(finite_floats, st.sampled_from([np.inf, -np.inf, np.nan, 0.0, -0.0, 1e-40, 3e-38]))


def activation_rows(elements: st.SearchStrategy) -> st.SearchStrategy:
    return st.integers(1, 9).flatmap(lambda rows: st.sampled_from([16, 32]).flatmap(
        lambda group: st.tuples(hnp.arrays(np.float32, (rows, group * 3), elements=elements), st.just(group))))


# --- the rounding --------------------------------------------------------------------------------------
@settings(max_examples=80, deadline=None)
@given(case=activation_rows(finite_floats))
def test_rounding_is_llama_cpps_q8_per_group(case):
    """q in [-127, 127], the group's largest magnitude at +-127, every value within half a step (plus
    float32 rounding of x / d) of q * d; an all-zero or underflowing group is zero."""
    x, group = case
    q, d = round_activations(x, group)
    assert q.dtype == np.int8 and d.dtype == np.float32 and d.shape == (x.shape[0], x.shape[1] // group)
    assert np.abs(q.astype(np.int16)).max() <= 127
    xg = x.reshape(x.shape[0], -1, group).astype(np.float64)
    qg = q.reshape(xg.shape).astype(np.float64)
    amax = np.abs(xg).max(axis=-1)
    live = d > 0
    assert np.all(np.abs(qg).max(axis=-1)[live] == 127)
    step = d.astype(np.float64)[..., None]
    assert np.all((np.abs(xg - qg * step) <= step * (0.5 + 1e-5))[live])
    assert np.all(qg[~live] == 0) and np.all(amax[~live] < 128 * 2.0 ** -126)


def test_a_non_finite_value_makes_its_group_nan_and_leaves_the_others():
    x = np.array([[1.0] * 16 + [np.nan] + [2.0] * 15, [np.inf] + [0.5] * 31]).astype(np.float32)
    x = np.concatenate([x, np.ones((2, 32), np.float32)], axis=1)
    back = rounded(x, 32)
    assert np.isnan(back[:, :32]).all() and np.array_equal(back[:, 32:], np.ones((2, 32), np.float32))


@needs_numba
@settings(max_examples=80, deadline=None)
@given(case=activation_rows(any_floats))
def test_compiled_rounding_has_the_references_bits(case):
    from kvlab.kernels.qgemv import _round_rows_parallel, round_rows, round_rows_into

    x, group = case
    q, d = round_activations(x, group)
    xq, dx, qsum, fsum = round_rows(x, group, -1)  # qbias is -bias * the sums: bias -1 gives the sums
    assert np.array_equal(xq, q) and np.array_equal(dx, d, equal_nan=True)
    # rows go over the threads from qgemv.ROUND_PARALLEL_ROWS on: both compiles, every row's bits alike
    serial = [np.empty_like(a) for a in (xq, dx, qsum, fsum)]
    parallel = [np.empty_like(a) for a in (xq, dx, qsum, fsum)]
    round_rows_into(x, group, np.int32(-1), *serial)
    _round_rows_parallel(x, group, np.int32(-1), *parallel)
    for got, want in zip(parallel, serial):
        assert np.array_equal(got.view(np.uint8), want.view(np.uint8))
    assert np.array_equal(qsum, q.reshape(*d.shape, group).astype(np.int32).sum(axis=-1))
    assert np.array_equal(fsum, d * qsum.astype(np.float32), equal_nan=True)


# --- the integer products ---------------------------------------------------------------------------------
def absolute_terms(type_name: str, raw: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """|scale * code| + |offset| per weight: what a product's rounding errors scale with (offsets are
    added per group, so cancellation inside a weight does not shrink them)."""
    u = unpack(type_name, raw, shape)
    terms = np.abs(dequantize(Unpacked(u.codes, np.abs(u.scales), None, u.group)).astype(np.float64))
    if u.offsets is not None:
        terms += np.repeat(np.abs(u.offsets).astype(np.float64), u.group, axis=1)
    return terms


@needs_numba
@settings(max_examples=60, deadline=None)
@given(type_name=st.sampled_from(BLOCK_TYPES), out=st.integers(1, 40), n_blocks=st.integers(1, 3),
       rows=st.integers(1, 20), scales=st.sampled_from(["normal", "max", "subnormal", "small", "mixed"]),
       seed=st.integers(0, 2**16))
def test_each_block_types_integer_product_equals_rounded_x_times_dequantized_w(type_name, out, n_blocks, rows,
                                                                             scales, seed):
    """<= 16 rows: the integer kernel (tiles and the row-ordered tail); > 16: rounded x and the prefill
    bands; both within float32 summation error of the float64 product of the rounded x and the file's
    dequantized values, elementwise; and the NumPy path agrees too."""
    rng = np.random.default_rng(seed)
    cols = n_blocks * BLOCK_SIZES[type_name][0]
    raw = blocks(type_name, out, cols, rng, scales)
    matrix = QuantizedMatrix.from_blocks(type_name, raw, (out, cols))
    x = (rng.standard_normal((rows, cols)) * rng.choice([1e-3, 1.0, 1e3])).astype(np.float32)
    xr = rounded(x, matrix.group).astype(np.float64)
    want = xr @ matrix.dequantize(np.float64).T
    bound = (cols + 8) * U * (np.abs(xr) @ absolute_terms(type_name, raw, (out, cols)).T) + 1e-37
    for compiled in (True, False):
        got = matrix.matmul_t(x, compiled, "q8")
        assert got.dtype == np.float32 and got.shape == (rows, out)
        assert np.all(np.abs(got - want) <= bound), (compiled, float(np.abs(got - want).max()))


@settings(max_examples=30, deadline=None)
@given(tiles=st.integers(1, 3), groups=st.integers(1, 3), nibbles=st.booleans(), seed=st.integers(0, 2**16))
def test_the_dot_layout_puts_four_columns_of_each_row_in_one_lane(tiles, groups, nibbles, seed):
    """Byte (g, q, r, c) of a tile's dot codes is row r's byte for column 4q + c of group g."""
    width = 16 if nibbles else 32
    codes = np.random.default_rng(seed).integers(0, 256, (tiles, groups * width * LANES), dtype=np.uint8)
    dot = to_dot_codes(codes, groups)
    assert dot.shape == (tiles, groups, width * LANES)
    by_row = codes.reshape(tiles, groups, width, LANES)   # (t, g, column, row)
    quads = dot.reshape(tiles, groups, width // 4, LANES, 4)   # (t, g, quad, row, column in quad)
    for column in range(width):
        assert np.array_equal(quads[:, :, column // 4, :, column % 4], by_row[:, :, column, :])


@settings(max_examples=30, deadline=None)
@given(tiles=st.integers(1, 3), groups=st.integers(1, 3), bias=st.sampled_from([0, 16]), seed=st.integers(0, 2**16))
def test_the_five_bit_dot_layout_keeps_a_nibble_and_a_bit_per_code(tiles, groups, bias, seed):
    """5-bit codes (Q5_0 / Q5_1 / Q5_K) in the dot layout: four planes of nibbles as Q4's (load q: row r's
    column 4q + c low, 16 + 4q + c high) and a plane whose byte 8q + r holds those eight columns' fifth bits;
    5 bits a code, and back to the same int8 codes, whole or a few rows at a time."""
    rng = np.random.default_rng(seed)
    codes = (rng.integers(0, 32, (tiles, groups * 32 * LANES)) - bias).astype(np.int8)
    dot = to_dot_codes5(codes, groups, bias)
    assert dot.shape == (tiles, groups, 5, 32) and dot.dtype == np.uint8 and dot.nbytes * 8 == codes.size * 5
    u = (codes.astype(np.int16) + bias).reshape(tiles, groups, 32, LANES)   # (t, g, column, row)
    nibbles = dot[:, :, :4].reshape(tiles, groups, 4, LANES, 4)   # (t, g, load, row, column in quad)
    bits = dot[:, :, 4].reshape(tiles, groups, 4, LANES)
    for column in range(16):
        q, c = column // 4, column % 4
        assert np.array_equal(nibbles[:, :, q, :, c] & 15, u[:, :, column] & 15)
        assert np.array_equal(nibbles[:, :, q, :, c] >> 4, u[:, :, 16 + column] & 15)
        assert np.array_equal((bits[:, :, q] >> c) & 1, u[:, :, column] >> 4)
        assert np.array_equal((bits[:, :, q] >> (4 + c)) & 1, u[:, :, 16 + column] >> 4)
    assert np.array_equal(from_dot_codes(dot, groups, bias), codes)
    index = rng.integers(0, tiles * LANES, 5)
    by_row = codes.reshape(tiles, groups, 32, LANES).transpose(0, 3, 1, 2).reshape(tiles * LANES, -1)
    assert np.array_equal(gather_dot_codes(dot, index, bias), by_row[index])
    with pytest.raises(ValueError, match="0..31"):
        to_dot_codes5(np.full_like(codes, 31 - bias + 1), groups, bias)


@settings(max_examples=30, deadline=None)
@given(tiles=st.integers(1, 3), groups=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_the_six_bit_dot_layout_keeps_a_nibble_and_a_crumb_per_code(tiles, groups, seed):
    """6-bit codes (Q6_K, -32..31, kept as code + 32) in the dot layout: two planes of nibbles (load p: row
    r's column 4p + c low, 8 + 4p + c high) and a plane of crumbs whose byte 4r + c holds those two columns'
    high bits at bits 4p and 4p + 2; int8 (the kernels' mark), 6 bits a code, and back to the same codes,
    whole or a few rows at a time."""
    rng = np.random.default_rng(seed)
    codes = (rng.integers(0, 64, (tiles, groups * 16 * LANES)) - 32).astype(np.int8)
    dot = to_dot_codes6(codes, groups, 32)
    assert dot.shape == (tiles, groups, 3, 32) and dot.dtype == np.int8 and dot.nbytes * 8 == codes.size * 6
    u = (codes.astype(np.int16) + 32).reshape(tiles, groups, 16, LANES)   # (t, g, column, row)
    nibbles = dot.view(np.uint8)[:, :, :2].reshape(tiles, groups, 2, LANES, 4)   # (t, g, load, row, column)
    crumbs = dot.view(np.uint8)[:, :, 2].reshape(tiles, groups, LANES, 4)   # (t, g, row, column in quad)
    for column in range(8):
        p, c = column // 4, column % 4
        assert np.array_equal(nibbles[:, :, p, :, c] & 15, u[:, :, column] & 15)
        assert np.array_equal(nibbles[:, :, p, :, c] >> 4, u[:, :, 8 + column] & 15)
        assert np.array_equal((crumbs[:, :, :, c] >> (4 * p)) & 3, u[:, :, column] >> 4)
        assert np.array_equal((crumbs[:, :, :, c] >> (4 * p + 2)) & 3, u[:, :, 8 + column] >> 4)
    assert np.array_equal(from_dot_codes(dot, groups, 32), codes)
    index = rng.integers(0, tiles * LANES, 5)
    by_row = codes.reshape(tiles, groups, 16, LANES).transpose(0, 3, 1, 2).reshape(tiles * LANES, -1)
    assert np.array_equal(gather_dot_codes(dot, index, 32), by_row[index])
    with pytest.raises(ValueError, match="0..63"):
        to_dot_codes6(np.full_like(codes, 32), groups, 32)


@needs_numba
@pytest.mark.parametrize("path", ["vnni", "madd", "generic"])
def test_every_code_path_of_the_integer_kernel(monkeypatch, path):
    """The VNNI instruction (where the CPU has it), AVX2's vpmaddubsw (the sign trick for 8-bit codes) and
    the generic IR for CPUs with neither: each compiled here afresh, each equal to the reference, and the
    assembly holds the path's instructions."""
    from numba import njit

    from kvlab.kernels import qdot
    from kvlab.kernels.qgemv import round_rows

    features = set(qdot._target_features().split(","))
    if path == "vnni" and not qdot.has_vnni():
        pytest.skip("the CPU has no AVX-512 VNNI / AVX-VNNI")
    if path == "madd" and "+avx2" not in features:
        pytest.skip("the CPU has no AVX2")
    vnni = path == "vnni"
    monkeypatch.setattr(qdot, "VNNI", vnni)
    monkeypatch.setattr(qdot, "MADD", path == "madd")

    @njit  # not cached: compiled with the flag as set now
    def first_tile(xq, dx, qbias, fsum, codes, scales, offsets, base_scales, base_offsets, out):
        qdot.tile_dot_2(xq, 0, dx, qbias, fsum, codes, scales, offsets, base_scales, base_offsets, 0, out)

    rng = np.random.default_rng(1)
    # int8 codes with float16 scales (as bits); nibbles with offsets; Q4_0's offsets folded; K types' scales
    # (and Q4_K's offsets) factored: int8 a group times a float32 base a super-block
    for type_name, scale_dtype, bias in (("Q8_0", np.uint16, 128), ("Q4_1", np.uint16, 0),
                                         ("Q4_0", np.uint16, 8), ("Q6_K", np.int8, 32), ("Q4_K", np.int8, 0),
                                         ("Q5_0", np.uint16, 16), ("Q5_1", np.uint16, 0), ("Q5_K", np.int8, 0)):
        raw = blocks(type_name, 8, 256, rng, "normal")
        matrix = QuantizedMatrix.from_blocks(type_name, raw, (8, 256))
        x = rng.standard_normal((2, 256)).astype(np.float32)
        out = np.empty((2, 8), dtype=np.float32)
        layout = matrix.dot_layout
        assert layout[1].dtype == scale_dtype and layout[3] == bias and (layout[2].size == 0) == (bias != 0)
        first_tile(*round_rows(x, matrix.group, layout[3]), *layout[:3], *layout[4:], out)
        want = rounded(x, matrix.group).astype(np.float64) @ matrix.dequantize(np.float64).T
        assert np.allclose(out, want, rtol=1e-5, atol=1e-6 * np.abs(want).max()), type_name
        asm = first_tile.inspect_asm(first_tile.signatures[-1])  # this type's compile
        assert ("vpdpbusd" in asm) == vnni
        assert ("vpmaddubsw" in asm) == (path == "madd")
        assert ("vpsignb" in asm) == (path == "madd" and layout[3] == 128), type_name  # 8-bit codes


@needs_numba
def test_a_tile_pair_gives_each_lane_the_single_tiles_bits():
    """Two tiles in one zmm register (qdot.PAIRS: 16 output rows a vpdpbusd), eight rows of x at a time:
    every output the bits of the one-tile kernel, for every scale layout (float16 bits, offsets, Q4_0's
    folded offsets, K types' factored scales and offsets). PAIRS needs VNNI, so pairs never take the
    generic IR."""
    from numba import njit

    from kvlab.kernels import qdot
    from kvlab.kernels.qgemv import round_rows

    if not qdot.PAIRS:
        pytest.skip("the CPU has no AVX-512 VNNI + BW: the kernels never pair tiles here")
    assert qdot.VNNI

    @njit
    def by_tile(xq, dx, qbias, fsum, codes, scales, offsets, base_scales, base_offsets, out):
        for t in range(2):
            for m in range(xq.shape[0]):
                qdot.tile_dot_1(xq, m, dx, qbias, fsum, codes, scales, offsets, base_scales, base_offsets, t, out)

    @njit
    def by_pair(xq, dx, qbias, fsum, codes, scales, offsets, base_scales, base_offsets, out):
        qdot.tile_dot_8x2(xq, 0, dx, qbias, fsum, codes, scales, offsets, base_scales, base_offsets, 0, out)

    rng = np.random.default_rng(2)
    for type_name in ("Q8_0", "Q4_1", "Q4_0", "Q6_K", "Q4_K", "Q5_0", "Q5_K"):
        raw = blocks(type_name, 16, 512, rng, "mixed")
        matrix = QuantizedMatrix.from_blocks(type_name, raw, (16, 512))
        layout = matrix.dot_layout
        x = rng.standard_normal((8, 512)).astype(np.float32)
        rounded_x = round_rows(x, matrix.group, layout[3])
        single = np.empty((8, 16), dtype=np.float32)
        by_tile(*rounded_x, *layout[:3], *layout[4:], single)
        paired = np.full((8, 16), np.nan, dtype=np.float32)
        by_pair(*rounded_x, *layout[:3], *layout[4:], paired)
        assert np.array_equal(paired.view(np.int32), single.view(np.int32)), type_name
        want = rounded(x, matrix.group).astype(np.float64) @ matrix.dequantize(np.float64).T
        assert np.allclose(single, want, rtol=1e-5, atol=1e-6 * np.abs(want).max()), type_name
    asm = "\n".join(by_pair.inspect_asm().values())
    assert re.search(r"vpdpbusd\s+[^\n]*zmm", asm), "the pair's products are not vpdpbusd on zmm registers"


# --- a model in the mode ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def q4_1_file(tmp_path_factory):
    from gguf_files import small_config, write_gguf

    path = tmp_path_factory.mktemp("q8act") / "m.gguf"
    # q/k/v a stack of Q4_1 and Q8_0 (the same in both layers: one variant of the fused kernels to compile)
    write_gguf(path, small_config("llama", max_position_embeddings=128),
               types=same_in_every_layer(q="Q4_1", k="Q8_0", v="Q4_1", o="Q8_0", gate="Q4_1", up="Q8_0", down="Q4_1"))
    return path


def logit_gap(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / (np.abs(b).max() + 1))


@needs_numba
def test_a_model_in_the_mode_agrees_with_the_numpy_reference_to_the_rounding_it_adds(q4_1_file):
    """Compiled (integer kernels on every path) against the NumPy reference in the same mode, over a full
    forward and a cached prefill + one-token steps. The paths compute the rounding's input (norms,
    attention) in different float32 orders, so a value on a rounding boundary can round the other way,
    and from there the two paths round differently: they agree to the size of the rounding itself, not to
    float32. So: the gap between them is at most twice the reference's own distance from the exact model,
    and that distance is real (the mode rounds: > 1e-3 of the logit scale), where a wrong scale or code
    would be of the order of the logits."""
    import kvlab

    reference, tokenizer = kvlab.load(q4_1_file, weights_dtype="stored", backend="numpy", activations="q8")
    model, _ = kvlab.load(q4_1_file, backend="numba", activations="q8")
    exact, _ = kvlab.load(q4_1_file, weights_dtype="float32", backend="numpy")
    assert model.activations == "q8" and exact.activations == "float32"
    ids = np.array([tokenizer.encode("The quick brown fox jumps over the lazy dog")[:12]])
    ids = np.concatenate([ids, kvlab.generate(exact, ids, 40)], axis=1)
    want = reference.forward(ids).logits
    rounding = logit_gap(exact.forward(ids).logits, want)
    assert rounding > 1e-3
    assert logit_gap(model.forward(ids).logits, want) <= 2 * rounding
    cache = model.new_cache(1)
    steps = [model.forward(ids[:, :3], cache=cache).logits]
    steps += [model.forward(ids[:, i:i + 1], cache=cache).logits for i in range(3, ids.shape[1])]
    assert logit_gap(np.concatenate(steps, axis=1), want) <= 2 * rounding
    # a row's integer products do not depend on the rows beside it: one step of a batch is the same step alone
    batch = model.forward(np.repeat(ids[:, :9], 3, axis=0)).logits
    assert np.array_equal(batch[0], batch[2]) and np.array_equal(batch[0], model.forward(ids[:, :9]).logits[0])


@needs_numba
def test_the_engine_serves_a_model_in_the_mode(q4_1_file):
    import kvlab

    model, _ = kvlab.load(q4_1_file, backend="numba", activations="q8")
    prompts = [[1, 5, 9, 13, 2, 7, 11], [1, 5, 9, 13, 2, 7, 11, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 4]]
    engine = kvlab.Engine(model, block_size=4, num_blocks=32)
    outputs = engine.generate(prompts, kvlab.SamplingParams(max_tokens=16))
    again = kvlab.Engine(model, block_size=4, num_blocks=32).generate(prompts, kvlab.SamplingParams(max_tokens=16))
    for output, repeat in zip(outputs, again):
        assert len(output.outputs[0].token_ids) == 16 and output.outputs[0].finish_reason == "length"
        assert output.outputs[0].token_ids == repeat.outputs[0].token_ids


@needs_numba
def test_the_mode_has_its_own_fingerprint_and_refuses_the_exact_models_cache(q4_1_file):
    import kvlab

    model, _ = kvlab.load(q4_1_file, backend="numba", activations="float32")
    exact_print = model.fingerprint
    # a prefill past the fused kernels' rows: the exact mode's stack of Q4_1 and Q8_0 never compiles here
    ids = np.arange(model.ops.max_fused_rows + 1)[None] % 50
    cache = model.forward(ids, use_cache=True).cache
    model.set_activations("q8")
    assert model.fingerprint != exact_print
    with pytest.raises(CacheMismatchError):
        model.forward(ids[:, :1], cache=cache)
    assert cache.get_seq_length() == ids.shape[1]
    model.set_activations(None)
    assert model.fingerprint == exact_print and model.activations == "float32"


def test_the_mode_is_refused_where_it_means_nothing_or_is_misspelt(q4_1_file):
    import kvlab

    with pytest.raises(InputError, match="has none"):
        kvlab.TinyLlama(seed=7).set_activations("q8")
    with pytest.raises(InputError, match="has none"):
        kvlab.load(q4_1_file, weights_dtype="float32", activations="q8")
    with pytest.raises(InputError, match="unknown activations 'q4'"):
        kvlab.load(q4_1_file, activations="q4")
    model, _ = kvlab.load(q4_1_file, backend="numpy")
    before = model.fingerprint
    with pytest.raises(InputError, match="unknown activations 'int4'"):
        model.set_activations("int4")
    assert model.activations == "float32" and model.fingerprint == before


def test_the_default_is_the_mode_for_block_types_on_the_compiled_backend(q4_1_file, tmp_path):
    """`activations` None/"auto" (every command's default): int8 activations where block-type matrices are
    kept as stored and run compiled (a GGUF file, an HF folder quantized at load); exact products for an
    F16 file, a dequantized load, the NumPy reference, or when asked."""
    import kvlab
    from gguf_files import small_config, write_gguf
    from kvlab.kernels import AVAILABLE

    compiled = "q8" if AVAILABLE else "float32"
    assert kvlab.load(q4_1_file)[0].activations == compiled
    assert kvlab.load(q4_1_file, activations="auto")[0].activations == compiled
    assert kvlab.load(q4_1_file, activations="float32")[0].activations == "float32"
    assert kvlab.load(q4_1_file, backend="numpy")[0].activations == "float32"
    assert kvlab.load(q4_1_file, weights_dtype="float32")[0].activations == "float32"
    assert kvlab.load(weights_dtype="q8_0")[0].activations == compiled  # the shipped model, quantized at load
    assert kvlab.load()[0].activations == "float32"  # the shipped float model
    half = tmp_path / "half.gguf"
    write_gguf(half, small_config("llama", max_position_embeddings=64), types=("F16",))
    assert kvlab.load(half)[0].activations == "float32"
    with pytest.raises(InputError, match="unknown activations 'q4'"):
        kvlab.load(q4_1_file, activations="q4")


def test_the_cli_takes_the_mode_and_refuses_it_for_a_float_model(q4_1_file):
    """`kvlab generate --activations q8` on a GGUF file of block types writes tokens; on the shipped float
    model it stops with the reason, before generating anything."""
    import subprocess
    import sys

    def run(*args):
        return subprocess.run([sys.executable, "-m", "kvlab", "generate", *args], capture_output=True, text=True,
                              timeout=600)

    ok = run("--model", str(q4_1_file), "--activations", "q8", "-n", "4", "--temperature", "0", "hello")
    assert ok.returncode == 0 and "decode 4 tokens" in ok.stderr, ok.stderr
    refused = run("--activations", "q8", "-n", "4", "ROMEO:")
    assert refused.returncode == 2 and "has none" in refused.stderr and not refused.stdout


@needs_numba
@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q6_K"])
def test_the_integer_products_at_their_extreme_codes_and_activations(type_name):
    """Codes at their extremes (Q8_0's -128 and 127, every nibble 15, every 5-bit code 31, Q6_K's -32 and 31
    with -17 and 16 between) against activations at +-127, where AVX2's 16-bit pair sums are largest
    (2 * 128 * 127 for the sign trick; eight of 2 * 15 * 127 an accumulator for nibbles, four of 2 * 31 * 127
    for 5-bit codes, two of 2 * 63 * 127 for Q6_K's code + 32, `qdot.nibble_pairs`): any saturation or wrap
    would move a product by far more than float32's rounding. Every row block (1..7 rows, and 16) against
    the float64 reference."""
    rng = np.random.default_rng(5)
    n, k = 16, 256
    block, size = BLOCK_SIZES[type_name]
    raw = np.zeros((n * k // block, size), dtype=np.uint8)
    raw[:, 0:2] = np.array([1.0], dtype="<f2").view(np.uint8)  # d = 1
    if type_name == "Q8_0":
        raw[:, 2:] = rng.choice(np.array([-128, 127, -128], dtype=np.int8), size=(raw.shape[0], 32)).view(np.uint8)
    elif type_name == "Q6_K":  # ql [128], qh [64]: each code's 4 + 2 bits all set or all clear; scales 1, d last
        raw[:, :192] = rng.choice(np.array([0x00, 0xFF, 0xFF], dtype=np.uint8), size=(raw.shape[0], 192))
        raw[:, 192:208] = 1
        raw[:, 208:210] = np.array([1.0], dtype="<f2").view(np.uint8)
    else:
        raw[:, size - (20 if type_name.startswith("Q5") else 16):] = 0xFF  # every nibble 15 (and fifth bit 1)
    matrix = QuantizedMatrix.from_blocks(type_name, raw.reshape(n, -1), (n, k))
    w = matrix.dequantize(np.float64)
    assert np.abs(w).max() in (128.0, 15.0, 7.0, 31.0, 32.0)
    for rows in (1, 2, 3, 4, 5, 6, 7, 16):
        x = rng.choice(np.array([-1.0, 1.0], dtype=np.float32), size=(rows, k))  # every activation +-127
        want = rounded(x, matrix.group).astype(np.float64) @ w.T
        got = matrix.matmul_t(x, True, "q8")
        assert np.allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max()), (type_name, rows)
