"""Qwen3, SmolLM3, Phi-3, Gemma 3 and Gemma 2 as GGUF files: kvlab's writer, kvlab's reader, transformers.

Per family, the tiny random checkpoint of tests/family_checkpoints.py (written by transformers'
`save_pretrained`) is written as GGUF by kvlab's writer (`kvlab quantize`'s HF path) and read back:

- the file holds exactly the `{arch}.*` keys and tensor names llama.cpp's `convert_hf_to_gguf.py` writes for
  the same checkpoint (recorded from a run of the converter of llama-cpp-python 0.3.36 on these
  checkpoints: same keys, same values, byte-identical tensors; Gemma 3's non-default layer pattern adds
  the `sliding_window_pattern` key llama.cpp reads, which its converter leaves out);
- transformers' own GGUF loading (`from_pretrained(dir, gguf_file=..., config=...)`), an independent reader
  of the tensor names, the fused Phi-3 matrices and Gemma's stored +1, rebuilds the checkpoint's logits
  exactly (SmolLM3: transformers has no smollm3 GGUF support);
- kvlab's model from the file: logits within 1e-4 (max|logit| + 1) of transformers' eager float32 forward on
  the folder, 24 greedy tokens equal to its `generate`, on the compiled and the NumPy backend;
- Q8_0 and Q4_0 files load both dequantized and as stored (the quantized kernels) and run;
- `kvlab convert` turns each file back into an HF folder transformers loads with the same logits;
- configs a llama.cpp file cannot carry are refused, naming the field, and leave no file.

GGUF fixes what llama.cpp derives or hard-codes, so the checkpoints here follow it where the HF fixtures
deliberately do not: Gemma's query_pre_attn_scalar is its head_dim (llama.cpp has no key for it),
SmolLM3's NoPE layers are every 4th (llama.cpp's rule), Gemma 2 is tied (llama.cpp's gemma2 has no output
matrix). Tied models get a final norm of random sign so their greedy tokens do not repeat one token.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import kvlab
import kvlab.kernels

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from family_checkpoints import FAMILIES, kvlab_run, make_family_checkpoint, parity_errors, transformers_run  # noqa: E402
from test_hf_parity import prompt_ids  # noqa: E402
from kvlab.cli.quantize import quantize_hf  # noqa: E402
from kvlab.errors import InputError  # noqa: E402
from kvlab.gguf.reader import read_gguf  # noqa: E402

TOLERANCE = 1e-4  # of max |logit| + 1
NEW_TOKENS = 24
PROMPT = {"phi3": 12}  # Phi-3 stays within its pretraining length (test_families_hf.py says why)
BACKENDS = ("numba", "numpy") if kvlab.kernels.AVAILABLE else ("numpy",)
GGUF_CHANGES = {"qwen3": {}, "smollm3": {"no_rope_layer_interval": 4}, "phi3": {},
                "gemma3": {"query_pre_attn_scalar": 16}, "gemma2": {"query_pre_attn_scalar": 16,
                                                                    "tie_word_embeddings": True}}
GGUF_ARCH = {"qwen3": "qwen3", "smollm3": "smollm3", "phi3": "phi3", "gemma3": "gemma3", "gemma2": "gemma2"}

# What llama.cpp's converter writes for these checkpoints: `{arch}.*` keys and per-layer tensor names
COMMON = {"attention.head_count", "attention.head_count_kv", "attention.layer_norm_rms_epsilon", "block_count",
          "context_length", "embedding_length", "feed_forward_length"}
HEAD = {"attention.key_length", "attention.value_length"}
CONVERTER_KEYS = {
    "qwen3": COMMON | HEAD | {"rope.freq_base"},
    "smollm3": COMMON | {"rope.dimension_count", "rope.freq_base", "vocab_size"},
    "phi3": COMMON | {"attention.sliding_window", "rope.dimension_count", "rope.freq_base",
                      "rope.scaling.attn_factor", "rope.scaling.original_context_length"},
    "gemma3": COMMON | HEAD | {"attention.sliding_window", "rope.freq_base", "rope.freq_base_swa",
                               "rope.scaling.factor", "rope.scaling.type"},
    "gemma2": COMMON | HEAD | {"attention.sliding_window", "attn_logit_softcapping", "final_logit_softcapping"},
}
EXTRA_KEYS = {"gemma3": {"attention.sliding_window_pattern"}}  # its layers are not llama.cpp's default 5:1
LLAMA = {"attn_k.weight", "attn_norm.weight", "attn_output.weight", "attn_q.weight", "attn_v.weight",
         "ffn_down.weight", "ffn_gate.weight", "ffn_norm.weight", "ffn_up.weight"}
GEMMA = LLAMA | {"post_attention_norm.weight", "post_ffw_norm.weight"}
QK_NORM = {"attn_q_norm.weight", "attn_k_norm.weight"}
CONVERTER_TENSORS = {
    "qwen3": (LLAMA | QK_NORM, {"output.weight", "output_norm.weight", "token_embd.weight"}),
    "smollm3": (LLAMA, {"output_norm.weight", "token_embd.weight"}),
    "phi3": ({"attn_norm.weight", "attn_output.weight", "attn_qkv.weight", "ffn_down.weight", "ffn_norm.weight",
              "ffn_up.weight"}, {"output.weight", "output_norm.weight", "rope_factors_long.weight",
                                 "rope_factors_short.weight", "token_embd.weight"}),
    "gemma3": (GEMMA | QK_NORM, {"output.weight", "output_norm.weight", "token_embd.weight"}),
    "gemma2": (GEMMA, {"output_norm.weight", "token_embd.weight"}),
}


def make_gguf_checkpoint(folder: Path, name: str) -> Path:
    """The family's checkpoint as a GGUF file can carry it; a tied model's final norm gets random signs."""
    from kvlab.hf.safetensors import load_file, save_file

    make_family_checkpoint(folder, name, **GGUF_CHANGES[name])
    weights = {k: np.array(v) for k, v in load_file(folder / "model.safetensors").items()}
    if "lm_head.weight" not in weights:  # tied
        shift = -1.0 if name.startswith("gemma") else 0.0  # Gemma's norms scale by (1 + w)
        norm = np.random.default_rng(0).normal(shift, 1.0, weights["model.norm.weight"].shape)
        weights["model.norm.weight"] = norm.astype(np.float32)
        save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(name, folder, F32 GGUF written by kvlab, prompt ids, transformers' run on the folder)."""
    name = request.param
    root = tmp_path_factory.mktemp(f"gguf-{name}")
    folder = make_gguf_checkpoint(root / "hf", name)
    path = root / f"{name}-f32.gguf"
    quantize_hf(folder, path, "F32")
    _, tokenizer = kvlab.load(path, backend="numpy")
    ids = prompt_ids(tokenizer, PROMPT.get(name, 20))
    return name, folder, path, ids, transformers_run(folder, ids, NEW_TOKENS)


def test_the_file_holds_what_llama_cpp_writes(family):
    name, folder, path, _, _ = family
    file = read_gguf(path)
    arch = GGUF_ARCH[name]
    assert file.get("general.architecture") == arch
    keys = {k[len(arch) + 1:] for k in file.metadata if k.startswith(arch + ".")}
    assert keys == CONVERTER_KEYS[name] | EXTRA_KEYS.get(name, set())
    per_layer, others = CONVERTER_TENSORS[name]
    layers = {t.split(".", 2)[2] for t in file.tensors if t.startswith("blk.")}
    assert layers == per_layer and {t for t in file.tensors if not t.startswith("blk.")} == others
    assert {t.type_name for t in file.tensors.values()} == {"F32"}
    config = kvlab.load(folder, backend="numpy")[0].config
    if name.startswith("gemma"):  # norms stored as (1 + w), exactly as transformers adds in float32
        from kvlab.hf.safetensors import load_file
        stored = file.raw("blk.0.post_attention_norm.weight").view("<f4")
        hf = np.asarray(load_file(folder / "model.safetensors")["model.layers.0.post_attention_layernorm.weight"])
        np.testing.assert_array_equal(stored, hf + np.float32(1))
    if name == "phi3":
        assert file.get("phi3.rope.dimension_count") == config.rotary_dim == 12
        assert file.tensors["blk.0.ffn_up.weight"].shape == (2 * config.intermediate_size, config.hidden_size)
    if name == "gemma3":
        assert file.get("gemma3.attention.sliding_window_pattern").tolist() == [True, False, True, False]


def _same_config(got, want) -> None:
    """Equal configs, floats to the float32 a GGUF stores them in."""
    _same(got.to_dict(), want.to_dict(), "config")


def _same(a, b, where: str) -> None:
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for key in a:
            _same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    elif isinstance(a, float) or isinstance(b, float):
        assert a == pytest.approx(b, rel=1e-6), where
    else:
        assert a == b, where


@pytest.mark.parametrize("backend", BACKENDS)
def test_logits_and_greedy_tokens_match_transformers(family, backend):
    name, folder, path, ids, want = family
    model, _ = kvlab.load(path, backend=backend)
    _same_config(model.config, kvlab.load(folder, backend="numpy")[0].config)
    got = kvlab_run(model, ids, NEW_TOKENS)
    errors = parity_errors(got, want)
    distinct = len(set(want["tokens"].tolist()))
    print(f"\n{name} GGUF ({backend}): max |logit error| / (max |logit| + 1): prompt {errors['prompt']:.1e}, "
          f"{NEW_TOKENS} greedy steps {errors['steps']:.1e}; tokens "
          f"{'identical' if np.array_equal(got['tokens'], want['tokens']) else 'DIFFER'} ({distinct} distinct)")
    np.testing.assert_array_equal(got["tokens"], want["tokens"])
    assert max(errors.values()) < TOLERANCE, errors
    assert distinct >= 3  # not one token repeated: the greedy comparison means something


@pytest.mark.parametrize("name", ["qwen3", "phi3", "gemma3", "gemma2"])
def test_transformers_gguf_loading_rebuilds_the_checkpoint(tmp_path, name):
    """An independent reader: transformers maps the GGUF tensor names, splits nothing it should not and
    takes Gemma's +1 off (its GGUF config mapping is too coarse for these tiny shapes, so the folder's
    config is given); its model's logits equal the folder's model's, bit for bit."""
    folder = make_gguf_checkpoint(tmp_path / "hf", name)
    quantize_hf(folder, tmp_path / "m.gguf", "F32")
    config = transformers.AutoConfig.from_pretrained(folder)
    kwargs = dict(dtype=torch.float32, attn_implementation="eager")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="m.gguf", config=config,
                                                               **kwargs).eval()
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, **kwargs).eval()
    ids = torch.tensor([[5, 9, 33, 100, 200, 7, 8, 250, 11, 12]])
    with torch.no_grad():
        assert torch.equal(theirs(ids).logits, reference(ids).logits)


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0"])
def test_quantized_files_load_and_run(family, tmp_path, type_name):
    """Matrices quantized, norms and LongRoPE factors F32. Loaded dequantized, the file computes what a
    model of the folder's weights quantized by kvlab computes (the file holds exactly those blocks); loaded
    as stored (the quantized kernels, Phi-3's fused blocks split by whole rows), the same logits and tokens."""
    from kvlab.gguf.tensors import split_fused
    from kvlab.loader import read_float_weights
    from kvlab.model.quantized import dequantized, quantize_weights

    name, folder, _, ids, want = family
    path = tmp_path / f"{name}-{type_name}.gguf"
    quantize_hf(folder, path, type_name)
    assert {info.type_name for info in read_gguf(path).tensors.values()} == {type_name, "F32"}
    reference, _ = kvlab.load(path, weights_dtype="float32")
    stored, _ = kvlab.load(path, weights_dtype="stored", activations="float32")  # exact products
    assert stored.quantized and not reference.quantized
    config, weights = read_float_weights(folder)
    expected = kvlab.LlamaModel(config, weights=split_fused(config, dequantized(quantize_weights(weights, type_name))),
                                dtype=np.float32, backend=reference.backend)
    a = reference.forward(ids).logits
    scale = np.abs(want["logits"]).max() + 1
    assert np.abs(a - expected.forward(ids).logits).max() / scale < 1e-6
    assert np.abs(a - stored.forward(ids).logits).max() / scale < TOLERANCE
    error = np.abs(a - want["logits"]).max() / scale
    print(f"\n{name} {type_name}: max |logit error| / (max |logit| + 1) vs float32 transformers {error:.1e}")
    assert error > TOLERANCE  # really quantized
    tokens = kvlab.generate(stored, ids, 8)[0]
    assert tokens.shape == (8,) and np.array_equal(tokens, kvlab.generate(reference, ids, 8)[0])
    # the default: int8 activations (but for Gemma 2's soft-capped scores), and a cached prefill plus
    # one-token steps give a full recompute's logits bit for bit (batch-invariant attention)
    default, _ = kvlab.load(path)
    assert default.activations == ("float32" if name == "gemma2" else "q8")
    if default.activations == "q8":
        cache = default.new_cache(1)
        steps = [default.forward(ids[:, :7], cache=cache).logits]
        steps += [default.forward(ids[:, i:i + 1], cache=cache).logits for i in range(7, ids.shape[1])]
        assert np.array_equal(np.concatenate(steps, axis=1), default.forward(ids).logits)


def test_kvlab_convert_gives_back_a_folder_transformers_loads(family, tmp_path):
    """GGUF -> HF folder (`kvlab convert`): Phi-3's matrices fused again under HF's names, Gemma's norms
    without the +1; transformers' logits on it equal its logits on the original folder (F32 file)."""
    from kvlab.cli.convert import convert

    name, folder, path, ids, want = family
    out = convert(path, tmp_path / "back")
    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32,
                                                             attn_implementation="eager").eval()
    with torch.no_grad():
        logits = back(torch.from_numpy(ids)).logits.numpy()
    assert np.abs(logits - want["logits"]).max() / (np.abs(want["logits"]).max() + 1) < 1e-6


@pytest.mark.parametrize("name, changes, words", [
    ("gemma3", {}, ["query_pre_attn_scalar 12", "derives 16"]),
    ("gemma2", {"query_pre_attn_scalar": 16}, ["untied Gemma 2", "tie_word_embeddings"]),
    ("smollm3", {}, ["no_rope_layers", "every 4th layer"]),
    ("gemma3", {"query_pre_attn_scalar": 16, "attn_logit_softcapping": 20.0}, ["attn_logit_softcapping"]),
])
def test_what_a_llama_cpp_file_cannot_carry_is_refused(tmp_path, name, changes, words):
    folder = make_family_checkpoint(tmp_path / "hf", name, **changes)
    out = tmp_path / "out" / "m.gguf"
    with pytest.raises(InputError) as info:
        quantize_hf(folder, out, "F32")
    assert all(w in str(info.value) for w in words), str(info.value)
    assert not out.parent.exists() or not any(out.parent.iterdir())


def test_llama_cpp_rules_for_what_the_converter_leaves_out(tmp_path):
    """No pattern key: llama.cpp's default (Gemma 3: 5 sliding layers, then a global one; i % 6 < 5), the
    27B layer count's attention scale (hidden / heads), Gemma 2's defaults (window 4096, caps 50/30),
    SmolLM3's NoPE every 4th layer: a file written with llama.cpp's own writer and only those keys."""
    from gguf_files import small_config, write_gguf

    from kvlab.gguf.config import config_from_metadata

    def head(writer) -> None:  # head_dim 32, not hidden / heads = 16: the two scales differ
        writer.add_key_length(32)
        writer.add_value_length(32)

    path = tmp_path / "g3.gguf"
    base = small_config("llama", num_hidden_layers=8, head_dim=32)
    write_gguf(path, base, arch="gemma3", extra=lambda w: (head(w), w.add_sliding_window(16)))
    config = config_from_metadata(read_gguf(path))
    assert [t == "sliding_attention" for t in config.layer_types] == [True] * 5 + [False] + [True] * 2
    assert config.interleaved_sliding_window == 16 and config.rope_local_base_freq == 10000.0
    assert config.query_pre_attn_scalar == 32 and config.final_logit_softcapping is None
    assert config.hidden_act == "gelu_pytorch_tanh" and config.norm_weight_offset == 1.0 and config.qk_norm
    path = tmp_path / "g2.gguf"
    write_gguf(path, base.replace(num_hidden_layers=46), arch="gemma2", extra=head)
    config = config_from_metadata(read_gguf(path))
    assert config.query_pre_attn_scalar == 64 // 4 and config.interleaved_sliding_window == 4096
    assert (config.attn_logit_softcapping, config.final_logit_softcapping) == (50.0, 30.0)
    assert config.layer_types[:4] == ("sliding_attention", "full_attention") * 2
    path = tmp_path / "s3.gguf"
    write_gguf(path, base, arch="smollm3", extra=head)
    assert config_from_metadata(read_gguf(path)).no_rope_layers == (1, 1, 1, 0, 1, 1, 1, 0)
