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

from gguf_files import assert_cached_logits_match, random_k_blocks, same_in_every_layer
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


# --- a model that keeps its weights quantized ---------------------------------------------------------
# A Q4_K_M-like mix of three types, the same in every layer: q/k/v a stack of three types, gate/up of two
MIXED = same_in_every_layer(q="Q4_K", k="Q6_K", v="Q5_0", o="Q4_K", gate="Q5_0", up="Q6_K", down="Q4_K")
def small_gguf(tmp_path, types):
    from gguf_files import small_config, write_gguf

    path = tmp_path / "m.gguf"
    k_quants = any(t.endswith("_K") for t in types)  # K-quant rows hold whole blocks of 256
    config = small_config("llama", max_position_embeddings=64, **(dict(hidden_size=256, intermediate_size=512)
                                                                  if k_quants else {}))
    written = write_gguf(path, config, types=types)
    return path, written


@pytest.mark.parametrize("backend", ["numba", "numpy"] if AVAILABLE else ["numpy"])
@pytest.mark.parametrize("types", [("Q8_0",), ("Q4_0", "Q4_1"), MIXED, ("F16", "Q8_0")],
                         ids=["Q8_0", "Q4_0-Q4_1", "mixed-K", "F16-Q8_0"])
def test_a_gguf_kept_as_stored_computes_the_dequantized_models_logits(tmp_path, backend, types):
    """`weights_dtype="stored"`: matrices stay codes (or half), the Q/K rows are unpermuted as whole rows,
    q/k/v of different types are stacked, and the logits, a decode through the cache and greedy tokens
    equal the dequantized model's (the reference) to float32 rounding of the sums."""
    import kvlab

    path, _ = small_gguf(tmp_path, types)
    reference, tokenizer = kvlab.load(path, backend="numpy", weights_dtype="float32")  # the reference
    model, _ = kvlab.load(path, weights_dtype="stored", backend=backend, activations="float32")
    assert model.quantized and any(isinstance(layer.w_qkv, QuantizedMatrix) or
                                   type(layer.w_qkv).__name__ == "RowStack" for layer in model.layers)
    assert_cached_logits_match(model, reference, tokenizer, prefill=5, greedy=12)
    assert model.fingerprint != reference.fingerprint  # a cache of one is refused by the other


def test_the_engine_and_verify_run_on_a_quantized_model(tmp_path):
    import kvlab
    from kvlab.verify import verify_model

    path, _ = small_gguf(tmp_path, ("Q8_0",))
    model, tokenizer = kvlab.load(path, weights_dtype="stored")
    engine = kvlab.Engine(model, tokenizer, block_size=4, num_blocks=64)
    prompt = tokenizer.encode("The quick brown fox")
    out = engine.generate([prompt], kvlab.SamplingParams(max_tokens=8))[0]
    assert out.outputs[0].token_ids == kvlab.generate(model, [prompt], 8)[0].tolist()
    results = verify_model(model)
    assert results and all(r.passed for r in results)


def test_quantize_at_load_and_bad_weight_choices(tmp_path):
    import kvlab
    from kvlab.errors import ConfigError

    model, _ = kvlab.load(weights_dtype="q8_0")
    assert model.quantized and isinstance(model.embed, QuantizedMatrix) and model.embed.type_name == "Q8_0"
    path, _ = small_gguf(tmp_path, ("Q8_0",))
    with pytest.raises(ConfigError, match="need float32 compute"):
        kvlab.load(path, dtype="float64", weights_dtype="stored")
    with pytest.raises(ConfigError, match="need float32 compute"):
        kvlab.load(dtype="float64", weights_dtype="q4_0")


@pytest.mark.parametrize("types", [MIXED, ("F16", "Q8_0", "Q4_1")], ids=["mixed-K", "F16-Q8_0-Q4_1"])
def test_memory_reports_the_resident_weight_bytes_of_a_gguf(tmp_path, types):
    """`kvlab memory --model x.gguf` gives the weights' resident bytes from the directory alone: what the
    loader keeps as stored (codes + float32 scales/offsets, half as half), and as float32."""
    import json
    import subprocess
    import sys

    from kvlab.cli.memory import gguf_weight_bytes
    from kvlab.gguf.loader import read_checkpoint

    path, _ = small_gguf(tmp_path, types)
    kept = read_checkpoint(path, np.float32, progress=False, keep_stored=True).weights
    assert any(isinstance(w, QuantizedMatrix) for w in kept.values())
    if types == MIXED:  # same_in_every_layer: every layer the same types per matrix, as asked
        for layer in range(2):
            names = [f"model.layers.{layer}.{m}.weight" for m in ("self_attn.q_proj", "self_attn.k_proj",
                     "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
            assert [kept[n].type_name for n in names] == ["Q4_K", "Q6_K", "Q5_0", "Q4_K", "Q5_0", "Q6_K", "Q4_K"]
    sized = gguf_weight_bytes(str(path))
    assert {k: sized[k] for k in ("weights_stored", "weights_float32")} == {
        "weights_stored": sum(w.nbytes for w in kept.values()),
        "weights_float32": 4 * sum(int(np.prod(w.shape)) for w in kept.values())}
    done = subprocess.run([sys.executable, "-m", "kvlab.cli", "memory", "--model", str(path), "--json"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["weight_bytes_stored"] == sum(w.nbytes for w in kept.values())


@pytest.mark.skipif(not AVAILABLE, reason="numba is not installed")
def test_decode_rows_take_the_fused_kernels_and_prefill_rows_the_bands(tmp_path):
    """Which path runs, counted: a layer of all-quantized matrices takes the fused block kernels for up to
    `max_fused_rows` rows (decode, the engine's batched decode) and the dequantized bands + BLAS above;
    so does a layer whose q/k/v or gate/up differ in type (a stack of matrices); a layer with an F16 matrix
    among Q8_0 ones never takes them. Both give the reference's logits (the
    test above), so only a count tells a wrong boundary from a right one."""
    import kvlab
    from kvlab.model.ops import QuantizedOps, make_ops

    from fused_calls import CountingFused as Counting

    # MIXED gives q/k/v and gate/up each several types: stacks (RowStack) that fuse too
    for types, fused in ((("Q8_0",), True), (MIXED, True), (("F16", "Q8_0"), False)):
        path, _ = small_gguf(tmp_path, types)
        model, _ = kvlab.load(path, weights_dtype="stored", backend="numba", activations="float32")
        ops = model.ops
        assert type(ops) is QuantizedOps
        counting = ops._qfused = Counting(ops._qfused)
        layers = model.config.num_hidden_layers
        for rows, expected in ((1, layers), (ops.max_fused_rows, layers), (ops.max_fused_rows + 1, 0)):
            counting.calls = {"qkv_rope": 0, "output_mlp": 0}
            model.forward(np.arange(rows)[None] % 50)
            want = expected if fused else 0
            assert counting.calls == {"qkv_rope": want, "output_mlp": want}, (types, rows)
    assert type(make_ops("numba", model.config, np.dtype(np.float32))) is not QuantizedOps  # float weights
