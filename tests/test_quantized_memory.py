"""Memory as the file (issue 37): one resident layout of the codes, views instead of copies, and the
prediction `kvlab memory --model` makes of what a model keeps."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from kvlab.model.ggml_quants import BLOCK_SIZES
from kvlab.model.quantized import QUANTIZE_TYPES, QuantizedMatrix, predicted_bytes


def unique_bytes(matrix: QuantizedMatrix) -> int:
    """Bytes of the memory blocks the matrix's arrays keep alive (each base array once)."""
    arrays = [*((*matrix._dot[:3], *matrix._dot[4:]) if matrix._tiles is None else
                (matrix._tiles.codes, matrix._tiles.scales, matrix._tiles.offsets)),
              matrix.tail.codes, matrix.tail.scales, matrix.tail.offsets]
    bases = {}
    for a in arrays:
        if a is None:
            continue
        while isinstance(a.base, np.ndarray):
            a = a.base
        bases[id(a)] = a.nbytes
    return sum(bases.values())


def same(a, b) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and a.dtype == b.dtype
                                         and np.array_equal(a.view(np.uint8), b.view(np.uint8)))


@settings(max_examples=40, deadline=None)
@given(type_name=st.sampled_from([t.upper() for t in QUANTIZE_TYPES]), rows=st.integers(1, 40),
       blocks=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_the_two_layouts_hold_the_same_weights_and_one_is_resident(type_name, rows, blocks, seed):
    """float -> dot -> float gives the float layout back bit for bit; rows, dequantized values, products and
    the fingerprint do not depend on which layout is resident; the matrix keeps exactly one (its bytes are
    what `predicted_bytes` says for that mode, and nothing else is kept alive)."""
    rng = np.random.default_rng(seed)
    cols = blocks * BLOCK_SIZES[type_name][0]
    matrix = QuantizedMatrix.quantize(rng.standard_normal((rows, cols)).astype(np.float32), type_name)
    original = matrix.tiles
    index = rng.integers(0, rows, 7)
    before = matrix.rows(index)
    x = rng.standard_normal((3, cols)).astype(np.float32)
    product = matrix.matmul_t(x, compiled=False)
    digest = hashlib.sha256(matrix.fingerprint_bytes()).hexdigest()
    assert matrix.layout == "float" and unique_bytes(matrix) == matrix.nbytes
    assert matrix.nbytes == predicted_bytes(type_name, (rows, cols)) == matrix.resident_bytes("float32")
    q8_bytes = matrix.resident_bytes("q8")

    matrix.dot_layout
    assert matrix.layout == "dot" and matrix._tiles is None
    assert matrix.nbytes == q8_bytes == unique_bytes(matrix) == predicted_bytes(type_name, (rows, cols), "q8")
    after = matrix.rows(index)
    assert all(same(getattr(before, f), getattr(after, f)) for f in ("codes", "scales", "offsets"))
    assert np.array_equal(matrix.matmul_t(x, compiled=False), product)
    assert hashlib.sha256(matrix.fingerprint_bytes()).hexdigest() == digest
    streamed = hashlib.sha256()
    matrix.fingerprint_into(streamed)
    assert streamed.hexdigest() == digest

    back = matrix.tiles
    assert matrix.layout == "float" and matrix._dot is None
    assert all(same(getattr(original, f), getattr(back, f)) for f in ("codes", "scales", "offsets"))


@pytest.mark.parametrize("rows", [64, 69])
def test_splitting_tiles_copies_the_tail_so_the_row_ordered_matrix_is_freed(rows):
    """A whole number of tiles leaves an empty tail: it must not be a view keeping the row-ordered codes
    (a second copy of every matrix) alive."""
    matrix = QuantizedMatrix.quantize(np.random.default_rng(0).standard_normal((rows, 64)).astype(np.float32), "Q4_0")
    assert unique_bytes(matrix) == matrix.nbytes == predicted_bytes("Q4_0", (rows, 64))


def test_row_views_share_the_stack_and_stack_back_to_it():
    """Views on tile boundaries share the stack's arrays; concatenated in order they are the stack itself;
    an unaligned or reordered request copies, with the same rows."""
    stack = QuantizedMatrix.quantize(np.random.default_rng(1).standard_normal((83, 64)).astype(np.float32), "Q8_0")
    parts = [stack.row_view(0, 32), stack.row_view(32, 48), stack.row_view(48, 83)]
    assert all(np.shares_memory(p.tiles.codes, stack.tiles.codes) for p in parts[:2])
    assert [p.shape for p in parts] == [(32, 64), (16, 64), (35, 64)]
    assert QuantizedMatrix.concat(parts) is stack
    for p, (a, b) in zip(parts, [(0, 32), (32, 48), (48, 83)]):
        assert np.array_equal(p.dequantize(), stack.dequantize()[a:b])
    odd = stack.row_view(3, 20)
    assert odd.view_of is None and np.array_equal(odd.dequantize(), stack.dequantize()[3:20])
    swapped = QuantizedMatrix.concat([parts[1], parts[0], parts[2]])
    assert swapped is not stack and np.array_equal(swapped.dequantize()[:16], stack.dequantize()[32:48])


def small_file(tmp_path, types):
    from gguf_files import small_config, write_gguf

    path = tmp_path / "m.gguf"
    write_gguf(path, small_config("llama", max_position_embeddings=64), types=types)
    return path


def test_the_reader_stacks_qkv_and_gate_up_once_and_the_model_keeps_that_stack(tmp_path):
    from kvlab.gguf.loader import load_gguf, read_checkpoint

    path = small_file(tmp_path, ("Q8_0",))
    weights = read_checkpoint(path, keep_stored=True, progress=False).weights
    q, k, v = (weights[f"model.layers.0.self_attn.{x}_proj.weight"] for x in "qkv")
    assert q.view_of[0] is k.view_of[0] is v.view_of[0]
    model, _ = load_gguf(path, weights_dtype="stored", progress=False)
    assert all(layer.w_qkv.view_of is None and layer.w_gate_up.view_of is None for layer in model.layers)


def test_read_pages_released_still_read_the_same(tmp_path):
    """`GGUFFile.release` only drops pages from the resident set: the bytes read again are the file's."""
    from kvlab.gguf.reader import read_gguf

    gguf = read_gguf(small_file(tmp_path, ("Q4_0",)))
    name = next(iter(gguf.tensors))
    before = np.array(gguf.raw(name))
    gguf.release(name)
    assert np.array_equal(np.asarray(gguf.raw(name)), before)


@pytest.mark.parametrize("types", [("Q8_0",), ("Q4_0",), ("Q4_1", "Q8_0")])
def test_memory_predicts_the_weights_a_model_keeps_in_each_mode(tmp_path, types):
    """`kvlab memory --model x.gguf --json`: the predicted peak's weight part is what the loaded model keeps
    (float layout, or with --activations q8 the integer kernels' layout), and in q8 mode, for Q8_0 and Q4_0
    with whole tiles, exactly the file's tensor bytes; K/V is the --tokens run's."""
    from kvlab.loader import load

    path = small_file(tmp_path, types)
    for mode in ("float32", "q8"):
        done = subprocess.run([sys.executable, "-m", "kvlab", "memory", "--model", str(path), "--tokens", "40",
                               "--activations", mode, "--json"], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        result = json.loads(done.stdout)
        peak = result["predicted_peak"]
        model, _ = load(path, activations=mode)
        matrices = {id(w): w for w in [model.embed, model.lm_head]
                    + [getattr(layer, n) for layer in model.layers for n in ("w_qkv", "w_o", "w_gate_up", "w_down")]}
        vectors = {id(a): a for layer in model.layers for a in (layer.input_norm, layer.post_norm)}
        vectors[id(model.norm)] = model.norm
        kept = sum(w.nbytes for w in matrices.values()) + sum(a.nbytes for a in vectors.values())
        flat = [p for w in matrices.values() for p in getattr(w, "parts", [w])]
        assert all(w.layout == ("dot" if mode == "q8" else "float") for w in flat)
        assert peak["weights"] == kept
        assert peak["kv"] == result["kv_bytes"] == 40 * result["bytes_per_token"]
        assert peak["peak"] == max(peak["load_peak"], peak["weights"] + peak["kv"] + peak["runtime"])
        if mode == "q8" and set(types) <= {"Q8_0", "Q4_0"}:  # Q4_1's mins stay float32: 1.1x the file
            assert peak["weights"] == result["file_tensor_bytes"]


@pytest.mark.skipif(not __import__("kvlab.kernels", fromlist=["AVAILABLE"]).AVAILABLE, reason="numba is not installed")
def test_a_q8_load_reads_into_the_integer_layout_and_computes_as_a_switched_model(tmp_path):
    """`load(path, activations="q8")` reads every matrix straight into the dot layout (views of the stacks
    included), and its logits and fingerprint are those of a model loaded exact and switched to q8."""
    from kvlab.gguf.loader import read_checkpoint
    from kvlab.loader import load

    path = small_file(tmp_path, ("Q4_0",))
    weights = read_checkpoint(path, keep_stored=True, progress=False, activations="q8").weights
    assert all(w.layout == "dot" for w in weights.values() if isinstance(w, QuantizedMatrix))
    assert weights["model.layers.1.mlp.up_proj.weight"].view_of is not None
    direct, _ = load(path, activations="q8")
    switched, _ = load(path)
    switched.set_activations("q8")
    ids = np.arange(1, 20)[None]
    assert direct.fingerprint == switched.fingerprint
    assert np.array_equal(direct.forward(ids).logits, switched.forward(ids).logits)


@pytest.mark.skipif(not __import__("kvlab.kernels", fromlist=["AVAILABLE"]).AVAILABLE, reason="numba is not installed")
@settings(max_examples=15, deadline=None)
@given(rows=st.integers(1, 16), out=st.integers(8, 40), blocks=st.integers(1, 4), seed=st.integers(0, 2**16),
       scale=st.sampled_from([1e-3, 1.0, 1e3]))
def test_q4_0s_folded_offsets_compute_the_bits_of_stored_ones(rows, out, blocks, seed, scale):
    """Q4_0's tiles keep no offsets (the kernels take the scales times -8): the products (one row or many,
    fused as the decode step calls them) and the prefill band's dequantized values are bit for bit those of
    the same tiles with the offsets stored."""
    from kvlab.kernels import qdecode_layer
    from kvlab.kernels.qgemv import dequantize_tiles_t, kernel_args, qmatmul
    from kvlab.model.ggml_quants import Unpacked

    rng = np.random.default_rng(seed)
    cols = 32 * blocks
    folded = QuantizedMatrix.quantize(rng.standard_normal((out, cols)).astype(np.float32), "Q4_0")
    t = folded.tiles
    assert t.offsets is None and t.offset_scale == -8.0 and folded.tail.offsets is not None
    stored = QuantizedMatrix("Q4_0", Unpacked(t.codes, t.scales, t.scales * np.float32(-8), t.group), folded.tail)
    x = (rng.standard_normal((rows, cols)) * scale).astype(np.float32)
    assert np.array_equal(qmatmul(x, folded.tiles, folded.tail), qmatmul(x, stored.tiles, stored.tail))
    fused = [np.empty((rows, out), dtype=np.float32) for _ in range(2)]
    for w, o in zip((folded, stored), fused):
        qdecode_layer._float_product(x, kernel_args(w.tiles, w.tail), o)
    assert np.array_equal(*fused)
    bands = [np.empty((cols, t.scales.shape[0] * 8), dtype=np.float32) for _ in range(2)]
    for w, band in zip((folded, stored), bands):
        dequantize_tiles_t(w.tiles, 0, t.scales.shape[0], band)
    assert np.array_equal(bands[0].view(np.uint32), bands[1].view(np.uint32))
    assert np.array_equal(folded.dequantize(), stored.dequantize())


@pytest.mark.parametrize("type_name", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"])
def test_k_types_keep_their_scales_factored_in_the_integer_layout(type_name):
    """A K type's scales (float16 d times a small sub-block scale) are kept by both layouts as an int8 a group
    and a float32 base a super-block and row: `kvlab memory` predicts those bytes before any conversion,
    the rows and the float layout read back the same float32 values, the exact products over the factored
    float layout are the float32 scales' bits, and a Q4_K matrix keeps about the file's bytes (float32
    scales and offsets took 1.33x)."""
    from gguf_files import blocks

    from kvlab.kernels import AVAILABLE

    rows, cols = 21, 512  # two whole tiles and a tail of five rows
    matrix = QuantizedMatrix.from_blocks(type_name, blocks(type_name, rows, cols, np.random.default_rng(3), "mixed"),
                                         (rows, cols))
    before = matrix.unpacked
    tiles = matrix.tiles  # the float layout, as loaded: factored too, and what `kvlab memory` predicts for it
    assert tiles.scales.dtype == np.int8 and tiles.base_scales.shape == (2, cols // 256 * 8)
    assert matrix.nbytes == matrix.resident_bytes("float32") == predicted_bytes(type_name, (rows, cols), "float32")
    assert np.array_equal(matrix.rows(np.array([20, 3, 9, 3])).scales, before.scales[[20, 3, 9, 3]])
    if AVAILABLE:  # the kernels over the factored scales against the same arrays with the float32 scales
        from kvlab.kernels.qgemv import dequantize_tiles_t, qmatmul
        from kvlab.model.ggml_quants import Unpacked
        from kvlab.model.qtiles import expand_scales

        widened = Unpacked(tiles.codes, expand_scales(tiles.scales, tiles.base_scales),
                           None if tiles.offsets is None else expand_scales(tiles.offsets, tiles.base_offsets),
                           tiles.group)
        x = np.random.default_rng(4).standard_normal((5, cols)).astype(np.float32)
        assert np.array_equal(qmatmul(x, tiles, matrix.tail), qmatmul(x, widened, matrix.tail))
        bands = [np.empty((cols, 16), dtype=np.float32) for _ in range(2)]
        dequantize_tiles_t(tiles, 0, 2, bands[0])
        dequantize_tiles_t(widened, 0, 2, bands[1])
        assert np.array_equal(bands[0], bands[1])
    predicted = matrix.resident_bytes("q8")
    assert predicted == predicted_bytes(type_name, (rows, cols), "q8")
    layout = matrix.dot_layout
    assert layout[1].dtype == np.int8 and layout[4].shape == (2, cols // 256 * 8)
    assert matrix.nbytes == predicted
    after = matrix.rows(np.array([20, 3, 9, 3]))  # tail and tile rows, one twice, read from the dot layout
    for field in ("codes", "scales", "offsets"):
        want = getattr(before, field)
        got = getattr(after, field)
        assert (want is None and got is None) or np.array_equal(got, want[[20, 3, 9, 3]]), field
    back = matrix.unpacked  # the float layout again, rebuilt from the factored scales
    assert np.array_equal(back.scales, before.scales) and np.array_equal(back.codes, before.codes)
    assert (before.offsets is None) == (back.offsets is None)
    assert before.offsets is None or np.array_equal(back.offsets, before.offsets)
    if type_name == "Q4_K":
        assert predicted_bytes(type_name, (4096, 4096), "q8") <= 1.06 * (4096 * 4096 // 256 * 144)


@pytest.mark.parametrize("type_name", ["Q5_0", "Q5_1", "Q5_K", "Q6_K"])
def test_packed_codes_keep_their_bits_in_the_exact_mode_too(type_name):
    """5- and 6-bit codes stay a nibble and a bit or a crumb (qtiles.to_packed_codes) in the float layout as
    in the integer one: one array both layouts share (converting moves no code), read back as the file's
    codes, dequantized by a prefill band to the file's values bit for bit (Q5_0's code + 16 with -16 * scale
    folded: both products exact; Q6_K's code + 32 taken off), multiplied by the exact kernel as the
    dequantized matrix is, and kept at <= 1.2x the file's bytes in both modes (with a byte a code, the
    exact mode kept Q5_0 at 1.64x, both modes Q6_K at 1.31x)."""
    from gguf_files import blocks

    from kvlab.kernels import AVAILABLE
    from kvlab.model.ggml_quants import dequantize, unpack

    rows, cols = 21, 512  # two whole tiles and a tail of five rows
    raw = blocks(type_name, rows, cols, np.random.default_rng(5), "mixed")
    file_values = dequantize(unpack(type_name, raw, (rows, cols)))
    matrix = QuantizedMatrix.from_blocks(type_name, raw, (rows, cols))
    codes = matrix.tiles.codes
    six = type_name == "Q6_K"  # int8 [T, G, 3, 32] (groups of 16), 5-bit codes uint8 [T, G, 5, 32]
    assert codes.dtype == (np.int8 if six else np.uint8)
    assert codes.shape == ((2, cols // 16, 3, 32) if six else (2, cols // 32, 5, 32))
    assert np.array_equal(matrix.unpacked.codes, unpack(type_name, raw, (rows, cols)).codes)
    assert np.array_equal(matrix.dequantize(), file_values)
    if AVAILABLE:
        from kvlab.kernels.qgemv import dequantize_tiles_t, qmatmul

        band = np.empty((cols, 16), dtype=np.float32)
        dequantize_tiles_t(matrix.tiles, 0, 2, band)
        assert np.array_equal(band.T.view(np.uint32), file_values[:16].view(np.uint32))
        x = np.random.default_rng(6).standard_normal((3, cols)).astype(np.float32)
        want = x.astype(np.float64) @ file_values.T.astype(np.float64)
        assert np.abs(qmatmul(x, matrix.tiles, matrix.tail) - want).max() <= 1e-5 * np.abs(want).max()
    assert matrix.dot_layout[0] is codes and matrix.tiles.codes is codes
    assert np.array_equal(matrix.dequantize(), file_values)
    block, size = BLOCK_SIZES[type_name]
    file_bytes = 4096 * 4096 // block * size
    for activations in ("float32", "q8"):
        assert predicted_bytes(type_name, (4096, 4096), activations) <= 1.2 * file_bytes, activations


@settings(max_examples=200, deadline=None)
@given(d=st.floats(-65504, 65504, width=16, allow_nan=False, allow_infinity=False),
       sc=st.lists(st.integers(-128, 127), min_size=16, max_size=16), per=st.sampled_from([8, 16]))
def test_factored_scales_are_the_same_float32_values(d, sc, per):
    """d * sc (exact in float32) factors back into int8s and one base whose float32 product is every value
    bit for bit, the ints no larger than the sub-block scales; the tiled layout [T, G * 8] is respected."""
    from kvlab.model.qtiles import expand_scales, factor_scales

    ints = np.array(sc[:per], dtype=np.float32)
    values = (np.float32(d) * ints)[None, :, None] * np.ones((1, 1, 8), dtype=np.float32)  # 8 lanes alike
    values[..., 3] *= np.float32(-1)  # a lane with the other sign
    tiled = np.ascontiguousarray(values.reshape(1, per * 8))
    factored = factor_scales(tiled, per)
    assert factored is not None
    got, base = factored
    assert got.dtype == np.int8 and base.shape == (1, 8)
    assert np.array_equal(expand_scales(got, base), tiled)
    assert np.abs(got.astype(np.int32)).max(initial=0) <= np.abs(ints).max(initial=0)
