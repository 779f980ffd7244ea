"""GGUF files written by llama.cpp's `gguf` writer, loaded by kvlab, matched against transformers' GGUF loading.

Three files cover every tensor type kvlab reads: a Llama with a SentencePiece vocabulary in F32, a tied
Qwen2 with q/k/v biases whose matrices cycle through F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1, and a
Llama (hidden 256, the K-quant block) whose matrices cycle through Q2_K, Q3_K, Q4_K, Q5_K and Q6_K. For each: float32
logits within 1e-4 of transformers' `from_pretrained(dir, gguf_file=...)`, equal to a kvlab model built
from the weights as written, and the same greedy tokens. Then the pieces: the header parser against
`gguf.GGUFReader`, dequantization against independent per-block decoders, the Q/K row order, and bad
files, which must raise errors naming the file and the field.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import kvlab
from gguf_files import K_QUANTS, TEXT, permute, small_config, write_gguf
from kvlab.errors import CheckpointError, ConfigError
from kvlab.gguf.reader import read_gguf
from kvlab.gguf.tensors import SUPPORTED_TYPES, dequantize, unpermute_rows
from kvlab.model.llama import LlamaModel

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-4
NEW_TOKENS = 12
LEGACY = ("F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
FILES = {
    "llama-spm-f32": dict(arch="llama", tokenizer="llama", types=("F32",), changes={}),
    "qwen2-bpe-legacy-quants": dict(arch="qwen2", tokenizer="gpt2", types=LEGACY, changes={}, pre="qwen2"),
    "llama-bpe-k-quants": dict(arch="llama", tokenizer="gpt2", types=K_QUANTS, pre="llama-bpe",
                               changes=dict(hidden_size=256, intermediate_size=512)),
}


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, tuple[Path, dict, object]]:
    """name -> (gguf path, the weights as written, config)."""
    out = {}
    for name, spec in FILES.items():
        folder = tmp_path_factory.mktemp(name)
        config = small_config(spec["arch"], **spec["changes"])
        written = write_gguf(folder / f"{name}.gguf", config, tokenizer=spec["tokenizer"], types=spec["types"],
                             pre=spec.get("pre", "default"))
        out[name] = (folder / f"{name}.gguf", written, config)
    return out


def test_the_files_cover_every_supported_type(files):
    seen = {info.type_name for path, _, _ in files.values() for info in read_gguf(path).tensors.values()}
    assert seen == set(SUPPORTED_TYPES)


@pytest.mark.parametrize("name", list(FILES))
def test_logits_and_greedy_tokens_match_transformers(files, name):
    path, written, config = files[name]
    model, tokenizer = kvlab.load(path, weights_dtype="float32")  # dequantized: the reference path
    assert model.config.architecture == config.architecture
    assert model.config.tie_word_embeddings == config.tie_word_embeddings
    ids = tokenizer.encode(TEXT)[:48]
    # kept as stored with exact products: the same logits to float32 rounding (the default for block types
    # rounds the products' inputs to int8, tests/test_int8_activations.py)
    stored, _ = kvlab.load(path, activations="float32")
    want = model.forward(np.array([ids])).logits
    assert np.abs(stored.forward(np.array([ids])).logits - want).max() <= 1e-4 * (np.abs(want).max() + 1)

    # the same weights, handed to kvlab directly: the GGUF path adds nothing (exact)
    direct = LlamaModel(model.config, weights=written, dtype=np.float32)
    ours = model.forward(np.array([ids])).logits[0]
    assert np.array_equal(ours, direct.forward(np.array([ids])).logits[0])

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                           dtype=torch.float32)
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits[0].numpy()
        greedy = hf.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                             attention_mask=torch.ones(1, len(ids), dtype=torch.long), eos_token_id=None,
                             pad_token_id=0)[0, len(ids):].tolist()
    error = float(np.abs(ours - theirs).max())
    print(f"{name}: max |kvlab - transformers| = {error:.2e}")
    assert error <= TOLERANCE
    assert list(kvlab.generate(model, [ids], NEW_TOKENS)[0]) == greedy


def test_float64_compute_and_cached_decode(files):
    path, _, _ = files["qwen2-bpe-legacy-quants"]
    model, tokenizer = kvlab.load(path, dtype="float64")
    assert model.dtype == np.float64
    ids = tokenizer.encode(TEXT)[:20]
    full = model.forward(np.array([ids])).logits[0]
    cache = model.new_cache(1)
    model.forward(np.array([ids[:-3]]), cache=cache, use_cache=True)
    steps = [model.forward(np.array([[t]]), cache=cache, use_cache=True).logits[0, -1] for t in ids[-3:]]
    assert np.abs(np.stack(steps) - full[-3:]).max() < 1e-10


def test_folder_holding_one_gguf_loads_and_two_are_refused(files, tmp_path):
    path, _, _ = files["llama-spm-f32"]
    assert kvlab.load(path.parent)[0].fingerprint == kvlab.load(path, progress=True)[0].fingerprint
    (tmp_path / "a.gguf").write_bytes(path.read_bytes())
    (tmp_path / "b.gguf").write_bytes(path.read_bytes())
    with pytest.raises(CheckpointError, match="2 .gguf files"):
        kvlab.load(tmp_path)


def test_header_parser_agrees_with_gguf_reader(files):
    path, _, _ = files["qwen2-bpe-legacy-quants"]
    ours, theirs = read_gguf(path), gguf.GGUFReader(path)
    assert [t.name for t in theirs.tensors] == list(ours.tensors)
    for tensor in theirs.tensors:
        info = ours.tensors[tensor.name]
        assert info.shape == tuple(int(s) for s in reversed(tensor.shape.tolist()))
        assert (info.type_name, info.start, info.nbytes) == (tensor.tensor_type.name, tensor.data_offset,
                                                             tensor.n_bytes)
    for key, field in theirs.fields.items():
        if key.startswith("GGUF."):
            continue
        value = field.contents()
        mine = ours.metadata[key]
        assert (mine.tolist() if isinstance(mine, np.ndarray) else mine) == pytest.approx(value), key


# --- dequantization: the gguf package's reference, and independent block decoders -----------------------------
def f16(raw: np.ndarray) -> np.ndarray:
    return raw.copy().view("<f2").astype(np.float32)


def q8_0_reference(block: np.ndarray) -> np.ndarray:
    """ggml's block_q8_0: f16 scale d, then 32 int8 quants; x = d * q."""
    return f16(block[:2])[0] * block[2:].view(np.int8).astype(np.float32)


def q4_k_reference(block: np.ndarray) -> np.ndarray:
    """ggml's block_q4_K (256 values): f16 d, f16 dmin, 12 bytes of packed 6-bit scales and mins, 128 bytes
    of 4-bit quants; eight groups of 32 values x = d * scale_j * q - dmin * min_j."""
    d, dmin = f16(block[0:4])
    packed, qs = block[4:16].astype(np.int32), block[16:144]

    def scale_min(j: int) -> tuple[int, int]:
        if j < 4:
            return packed[j] & 63, packed[j + 4] & 63
        return ((packed[j + 4] & 0xF) | ((packed[j - 4] >> 6) << 4),
                (packed[j + 4] >> 4) | ((packed[j] >> 6) << 4))

    out = []
    for chunk in range(4):  # 64 values per 32 quant bytes: low nibbles, then high nibbles
        q = qs[32 * chunk:32 * chunk + 32].astype(np.int32)
        for half, nibbles in enumerate((q & 0xF, q >> 4)):
            scale, minimum = scale_min(2 * chunk + half)
            out.append(d * scale * nibbles - dmin * minimum)
    return np.concatenate(out).astype(np.float32)


@pytest.mark.parametrize("type_name", SUPPORTED_TYPES)
def test_dequantize_equals_the_reference_and_roundtrips(tmp_path, type_name):
    from gguf_files import random_k_blocks

    rng = np.random.default_rng(3)
    kind = gguf.GGMLQuantizationType[type_name]
    original = rng.standard_normal((300, 256)).astype(np.float32)  # 300 rows: more than one chunk
    data = (random_k_blocks(300, 256, type_name, rng) if type_name in K_QUANTS
            else gguf.quants.quantize(original, kind))
    writer = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    writer.add_tensor("t", data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    file = read_gguf(tmp_path / "t.gguf")
    ours = dequantize(file, file.tensors["t"], np.dtype(np.float32))
    reference = gguf.quants.dequantize(data, kind).reshape(300, 256)
    assert np.array_equal(ours, reference)
    if type_name not in K_QUANTS:  # the quantization error of each format, relative to the row scale
        bound = {"F32": 0, "F16": 1e-3, "BF16": 1e-2, "Q8_0": 2e-2, "Q5_0": 0.1, "Q5_1": 0.1}.get(type_name, 0.25)
        assert np.abs(ours - original).max() <= bound * np.abs(original).max()
    blocks = np.asarray(data).reshape(-1, gguf.GGML_QUANT_SIZES[kind][1])
    if type_name == "Q8_0":
        assert np.array_equal(ours.reshape(-1, 32)[:50], np.stack([q8_0_reference(b) for b in blocks[:50]]))
    if type_name == "Q4_K":
        assert np.allclose(ours.reshape(-1, 256)[:20], np.stack([q4_k_reference(b) for b in blocks[:20]]),
                           rtol=1e-6, atol=1e-7)


@given(heads=st.integers(1, 6), half=st.integers(1, 8), cols=st.integers(1, 5), bias=st.booleans())
def test_unpermute_inverts_llama_cpp_permutation(heads, half, cols, bias):
    shape = (heads * 2 * half,) if bias else (heads * 2 * half, cols)
    weight = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    assert np.array_equal(unpermute_rows(permute(weight, heads), heads), weight)
    if half > 1:
        assert not np.array_equal(permute(weight, heads), weight)


# --- bad files ---------------------------------------------------------------------------------------------------
@pytest.fixture()
def good(tmp_path) -> Path:
    path = tmp_path / "good.gguf"
    write_gguf(path, small_config("llama"), tokenizer="gpt2", types=("Q8_0",))
    return path


def expect(error: type, path: Path, *fragments: str) -> None:
    with pytest.raises(error) as caught:
        kvlab.load(path)
    message = str(caught.value)
    assert str(path) in message, message
    for fragment in fragments:
        assert fragment in message, message


def test_wrong_magic_and_empty_file(good, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + good.read_bytes()[4:])
    expect(CheckpointError, bad, "not a GGUF file", "b'GGML'")
    bad.write_bytes(b"")
    expect(CheckpointError, bad, "too short")


def test_truncated_files_name_what_was_cut(good, tmp_path):
    raw = good.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(raw[:-100])
    last = list(read_gguf(good).tensors)[-1]
    expect(CheckpointError, cut, "truncated", f"tensor {last!r}")
    cut.write_bytes(raw[:300])
    expect(CheckpointError, cut, "truncated while reading", "metadata 'llama.")


def test_unknown_and_unsupported_tensor_types(good, tmp_path):
    raw = bytearray(good.read_bytes())
    name = list(read_gguf(good).tensors)[-1].encode()
    at = raw.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    n_dims = struct.unpack_from("<I", raw, at)[0]
    type_at = at + 4 + 8 * n_dims
    bad = tmp_path / "bad.gguf"
    raw[type_at:type_at + 4] = struct.pack("<I", 99)
    bad.write_bytes(bytes(raw))
    expect(CheckpointError, bad, f"tensor {name.decode()!r}", "unknown ggml type 99")
    raw[type_at:type_at + 4] = struct.pack("<I", int(gguf.GGMLQuantizationType.IQ4_NL))  # fewer bytes
    bad.write_bytes(bytes(raw))
    expect(CheckpointError, bad, f"tensor {name.decode()!r}", "IQ4_NL", "supported tensor types")


def test_shapes_that_disagree_with_the_metadata(tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(path, small_config("llama"), metadata=small_config("llama", intermediate_size=96))
    expect(CheckpointError, path, "mlp.gate_proj.weight", "(128, 64)", "(96, 64)")


def test_unsupported_architecture_and_missing_keys(tmp_path):
    path = tmp_path / "phi.gguf"
    write_gguf(path, small_config("llama"), arch="phi2")
    expect(ConfigError, path, "'phi2'", "llama, mistral, qwen2")
    path = tmp_path / "nokey.gguf"
    write_gguf(path, small_config("llama"), extra=lambda w: w.kv_data[0].pop("llama.block_count"))
    expect(ConfigError, path, "'llama.block_count'", "missing")


def test_rope_scaling_from_metadata(tmp_path):
    path = tmp_path / "linear.gguf"
    write_gguf(path, small_config("llama"), extra=lambda w: (w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR),
                                                             w.add_rope_scaling_factor(4.0)))
    model, _ = kvlab.load(path)
    assert model.config.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    path = tmp_path / "yarn.gguf"
    write_gguf(path, small_config("llama"), extra=lambda w: (w.add_rope_scaling_type(gguf.RopeScalingType.YARN),
                                                             w.add_rope_scaling_factor(4.0)))
    expect(ConfigError, path, "'llama.rope.scaling.type'", "'yarn'")


def converter_rope_factors(head_dim: int, theta: float, factor: float, low: float, high: float,
                           old: int) -> np.ndarray:
    """What llama.cpp's converter writes as `rope_freqs` for a Llama 3 rope_scaling (its loop, restated)."""
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * np.pi * theta ** (i / head_dim)
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


@pytest.mark.parametrize("theta,factor,low,high,old", [(500000.0, 8.0, 1.0, 4.0, 8192),
                                                      (10000.0, 4.0, 1.0, 8.0, 256)])
def test_llama3_rope_factors_become_llama3_rope_scaling(tmp_path, theta, factor, low, high, old):
    config = small_config("llama", rope_theta=theta)
    factors = converter_rope_factors(config.head_dim, theta, factor, low, high, old)
    assert 1 < len(set(factors.tolist())) and factors.max() == factor
    path = tmp_path / "llama3.gguf"
    written = write_gguf(path, config, extra=lambda w: w.add_tensor("rope_freqs.weight", factors))
    model, tokenizer = kvlab.load(path)
    scaling = model.config.rope_scaling
    assert scaling["rope_type"] == "llama3" and scaling["factor"] == factor
    assert scaling["original_max_position_embeddings"] / scaling["high_freq_factor"] == pytest.approx(old / high)
    assert scaling["original_max_position_embeddings"] / scaling["low_freq_factor"] == pytest.approx(old / low)
    hf_style = model.config.replace(rope_scaling={"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                                                  "high_freq_factor": high, "original_max_position_embeddings": old})
    reference = LlamaModel(hf_style, weights=written, dtype=np.float32)
    ids = np.array([tokenizer.encode(TEXT)[:100]])
    assert np.abs(model.forward(ids).logits - reference.forward(ids).logits).max() < 1e-4
    plain = LlamaModel(model.config.replace(rope_scaling=None), weights=written, dtype=np.float32)
    assert np.abs(model.forward(ids).logits - plain.forward(ids).logits).max() > 1e-3  # the factors matter


def test_rope_factors_that_are_not_llama3_are_refused(tmp_path):
    config = small_config("llama")
    factors = np.linspace(1, 3, config.head_dim // 2).astype(np.float32)[::-1].copy()
    path = tmp_path / "odd.gguf"
    write_gguf(path, config, extra=lambda w: w.add_tensor("rope_freqs.weight", factors))
    expect(ConfigError, path, "'rope_freqs.weight'", "does not follow Llama 3")


def test_mistral_stored_as_llama_keeps_its_window(tmp_path):
    config = small_config("llama")
    path = tmp_path / "mistral.gguf"
    written = write_gguf(path, config, name="Mistral 7B Instruct v0.1",
                         extra=lambda w: w.add_uint32("llama.attention.sliding_window", 8))
    model, tokenizer = kvlab.load(path)
    assert model.config.architecture == "MistralForCausalLM" and model.config.sliding_window == 8
    ids = np.array([tokenizer.encode(TEXT)[:40]])
    windowed = LlamaModel(model.config, weights=written, dtype=np.float32)
    assert np.array_equal(model.forward(ids).logits, windowed.forward(ids).logits)
    full = LlamaModel(model.config.replace(sliding_window=None), weights=written, dtype=np.float32)
    assert np.abs(model.forward(ids).logits - full.forward(ids).logits).max() > 1e-3
