"""Real checkpoints written by transformers itself, loaded by kvlab, matched against transformers.

For every architecture and variant kvlab claims (Llama GQA / MQA, tied and untied embeddings, llama3 and
linear RoPE scaling, Qwen2's q/k/v biases, Mistral with a window shorter than the prompt, bfloat16 and
float16 files kept half precision in memory, a sharded file) a tiny random model is saved with `save_pretrained`, loaded with `kvlab.load`, and checked:
float32 logits within 1e-4 over a prompt (full forward, and prefill + cached decode) and at each of 40
steps of transformers' `generate(do_sample=False)`, whose greedy tokens kvlab must reproduce exactly. Run with `-s` to see the measured errors.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import kvlab
import kvlab.kernels

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

TOLERANCE = 1e-4
NEW_TOKENS = 40
CORPUS = ("To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer the slings "
          "and arrows of outrageous fortune, or to take arms against a sea of troubles. Ünïcødé façade 😀.")
BASE = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6,
            bos_token_id=0, eos_token_id=1)

VARIANTS = {
    "llama-gqa": ("LlamaForCausalLM", {}),
    "llama-mqa-tied": ("LlamaForCausalLM", {"num_key_value_heads": 1, "tie_word_embeddings": True}),
    "llama-mha": ("LlamaForCausalLM", {"num_key_value_heads": 4, "head_dim": 8}),
    "llama3-rope": ("LlamaForCausalLM", {"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16}}),
    "linear-rope": ("LlamaForCausalLM", {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0,
                                                             "factor": 4.0}}),
    "qwen2-bias": ("Qwen2ForCausalLM", {}),
    "qwen2-bias-tied-mqa": ("Qwen2ForCausalLM", {"tie_word_embeddings": True, "num_key_value_heads": 1}),
    "mistral-window": ("MistralForCausalLM", {"sliding_window": 8}),
}


def build_tokenizer(folder: Path) -> None:
    """A 320-token byte-level BPE (with <s>, </s>) trained in milliseconds, saved as HF files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=BASE["vocab_size"], special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([CORPUS] * 4, trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "add_bos_token": True}))


def randomize(model) -> None:
    """Weights far from transformers' tiny init, so attention is peaked and greedy tokens vary.

    N(0, 1/fan_in) matrices, N(1, 0.1) norms, N(0, 1) embeddings, N(0, 0.1) biases (as kvlab's
    random_weights), with output projections 3x larger so that a tied model does not just repeat its
    input token: an error in masking, rotation or grouping then moves logits by O(1).
    """
    gen = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * noise)
            elif "embed_tokens" in name:
                p.copy_(noise)
            elif name.endswith(".bias"):
                p.copy_(0.1 * noise)
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                p.copy_(3.0 * noise / p.shape[-1] ** 0.5)  # blocks that move the residual stream
            else:
                p.copy_(noise / p.shape[-1] ** 0.5)


def make_checkpoint(folder: Path, architecture: str, changes: dict, *, dtype=None,
                    max_shard_size: str | None = None) -> Path:
    config_class = {"LlamaForCausalLM": transformers.LlamaConfig, "MistralForCausalLM": transformers.MistralConfig,
                    "Qwen2ForCausalLM": transformers.Qwen2Config}[architecture]
    config = config_class(**{**BASE, **changes})
    config.architectures = [architecture]
    torch.manual_seed(0)
    model = getattr(transformers, architecture)(config).eval()
    randomize(model)
    if dtype is not None:
        model = model.to(dtype)
    folder.mkdir(parents=True, exist_ok=True)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **kwargs)
    build_tokenizer(folder)
    return folder


def reference(folder: Path):
    """A fresh float32 load (from a bfloat16 file too: RoPE's inv_freq must not be rounded to bf16)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # compare fixed-length runs
    model.generation_config.pad_token_id = 1
    return model


def prompt_ids(tokenizer, length: int = 24) -> np.ndarray:
    ids = tokenizer.encode(CORPUS)[:length]
    assert len(ids) == length
    return np.array([ids])


def check_parity(folder: Path, name: str, backend: str | None = None) -> dict[str, float]:
    """Logits over the prompt (full, and prefill + one-token decode steps) and along a 40-token greedy run."""
    model, tokenizer = kvlab.load(folder, backend=backend)
    ref = reference(folder)
    ids = prompt_ids(tokenizer)
    with torch.no_grad():
        want = ref(torch.from_numpy(ids)).logits.numpy()
        prompt = torch.from_numpy(ids)  # an explicit mask: else generate() takes <bos> = pad id 0 for padding
        run = ref.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW_TOKENS,
                           do_sample=False, output_logits=True, return_dict_in_generate=True)
    want_tokens = run.sequences[0, ids.shape[1]:].numpy()
    want_steps = torch.cat(run.logits).numpy()  # [NEW_TOKENS, vocab]: what generate() chose from

    full = model.forward(ids).logits
    cache = model.new_cache()
    split = ids.shape[1] - 8
    parts = [model.forward(ids[:, :split], cache=cache).logits]
    parts += [model.forward(ids[:, i:i + 1], cache=cache).logits for i in range(split, ids.shape[1])]
    cached = np.concatenate(parts, axis=1)
    got_tokens = kvlab.generate(model, ids, NEW_TOKENS)[0]
    cache = model.new_cache()
    steps = [model.forward(ids, cache=cache, logits_to_keep=1).logits[0, -1]]
    steps += [model.forward([[t]], cache=cache).logits[0, -1] for t in got_tokens[:-1]]
    errors = {"full": float(np.abs(full - want).max()), "cached": float(np.abs(cached - want).max()),
              "generate": float(np.abs(np.stack(steps) - want_steps).max())}
    print(f"\n{name}: max |logit error| prompt full {errors['full']:.1e}, prompt prefill+decode "
          f"{errors['cached']:.1e}, {NEW_TOKENS} generate steps {errors['generate']:.1e} (|logits| up to "
          f"{np.abs(want).max():.1f}); greedy tokens "
          f"{'identical' if np.array_equal(got_tokens, want_tokens) else 'DIFFER'}")
    np.testing.assert_array_equal(got_tokens, want_tokens)
    assert max(errors.values()) < TOLERANCE, errors
    return errors


@pytest.mark.parametrize("name", list(VARIANTS))
def test_logits_and_greedy_tokens_match_transformers(tmp_path, name):
    architecture, changes = VARIANTS[name]
    check_parity(make_checkpoint(tmp_path / name, architecture, changes), name)


def test_mistral_window_really_shorter_than_the_prompt(tmp_path):
    """The window must matter: the same weights without it give different logits past position 8."""
    folder = make_checkpoint(tmp_path / "m", "MistralForCausalLM", {"sliding_window": 8})
    model, tokenizer = kvlab.load(folder)
    assert model.config.sliding_window == 8
    ids = prompt_ids(tokenizer)
    unwindowed = kvlab.LlamaModel(model.config.replace(sliding_window=None), weights=_hf_weights(folder))
    diff = np.abs(model.forward(ids).logits - unwindowed.forward(ids).logits).max(axis=-1)[0]
    assert diff[:8].max() < 1e-5 and diff[8:].min() > 1e-3


def _hf_weights(folder: Path) -> dict[str, np.ndarray]:
    from kvlab.hf.safetensors import load_file
    return dict(load_file(folder / "model.safetensors"))


HALF_FILES = {"bfloat16-llama": ("LlamaForCausalLM", {}, "bfloat16"),
              "bfloat16-qwen2-tied": ("Qwen2ForCausalLM", {"tie_word_embeddings": True}, "bfloat16"),
              "float16-mistral-window": ("MistralForCausalLM", {"sliding_window": 8}, "float16")}


@pytest.mark.parametrize("name", list(HALF_FILES))
def test_half_precision_checkpoint_kept_as_stored(tmp_path, name):
    """A bfloat16/float16 file stays half precision in memory (weights_dtype="auto") and its float32 math
    matches transformers' float32 run of the same file to 1e-4, on each backend."""
    architecture, changes, stored = HALF_FILES[name]
    folder = make_checkpoint(tmp_path / name, architecture, changes, dtype=getattr(torch, stored))
    header = json.loads((folder / "config.json").read_text())
    assert header.get("dtype", header.get("torch_dtype")) == stored
    from kvlab.hf.safetensors import read_header
    assert {t.dtype.name for t in read_header(folder / "model.safetensors").tensors.values()} == {stored}
    for backend in ("numba", "numpy") if kvlab.kernels.AVAILABLE else ("numpy",):
        model, _ = kvlab.load(folder, backend=backend)
        assert model.weights_dtype.name == stored and model.layers[0].w_qkv.dtype.name == stored
        check_parity(folder, f"{name}-{backend}", backend=backend)
    forced, _ = kvlab.load(folder, weights_dtype="float32")
    assert forced.weights_dtype == np.float32


def test_sharded_checkpoint(tmp_path):
    folder = make_checkpoint(tmp_path / "sharded", "Qwen2ForCausalLM", {}, max_shard_size="60KB")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 3
    assert not (folder / "model.safetensors").exists()
    check_parity(folder, "qwen2-sharded")


def test_float64_compute_is_closer_still(tmp_path):
    folder = make_checkpoint(tmp_path / "f64", "LlamaForCausalLM", {})
    model64, tokenizer = kvlab.load(folder, dtype="float64")
    model32, _ = kvlab.load(folder)
    ids = prompt_ids(tokenizer)
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()
    with torch.no_grad():
        want = ref(torch.from_numpy(ids)).logits.numpy()
    assert model64.forward(ids).logits.dtype == np.float64
    # transformers rounds RoPE angles through float32 even in float64, hence ~1e-6 rather than 1e-12
    assert np.abs(model64.forward(ids).logits - want).max() < 1e-5
    cache = model64.new_cache()
    model64.forward(ids[:, :10], cache=cache)
    cached = model64.forward(ids[:, 10:], cache=cache).logits
    assert np.abs(cached - model64.forward(ids).logits[:, 10:]).max() <= 1e-10
    assert np.abs(model32.forward(ids).logits - want).max() < TOLERANCE


@pytest.mark.parametrize("kv_dtype", ["float16", "bfloat16"])
def test_low_precision_kv_cache_still_tracks_transformers(tmp_path, kv_dtype):
    folder = make_checkpoint(tmp_path / kv_dtype, "LlamaForCausalLM", {})
    model, tokenizer = kvlab.load(folder)
    ids = prompt_ids(tokenizer)
    with torch.no_grad():
        want = reference(folder)(torch.from_numpy(ids)).logits.numpy()
    cache = model.new_cache(kv_dtype=kv_dtype)
    model.forward(ids[:, :12], cache=cache)
    got = model.forward(ids[:, 12:], cache=cache).logits
    assert cache.dtype.name == kv_dtype
    err = np.abs(got - want[:, 12:]).max()
    # measured max error 1.1e-3 (float16) and 8.8e-3 (bfloat16) on logits up to 3.8; bounds ~4x that
    assert 0 < err < (4e-3 if kv_dtype == "float16" else 3.5e-2)


def test_tokenizer_and_text_match_transformers(tmp_path):
    folder = make_checkpoint(tmp_path / "tok", "LlamaForCausalLM", {})
    model, tokenizer = kvlab.load(folder)
    hf_tok = transformers.AutoTokenizer.from_pretrained(folder)
    text = "Whether 'tis nobler: façade 😀"
    assert tokenizer.encode(text, add_bos=False) == hf_tok(text, add_special_tokens=False).input_ids
    assert tokenizer.encode(text)[0] == tokenizer.bos_token_id == 0  # add_bos_token: true
    assert tokenizer.eos_token_ids == (1,)
    ids = prompt_ids(tokenizer)
    new = kvlab.generate(model, ids, 16)[0].tolist()
    assert tokenizer.decode(new) == hf_tok.decode(new, skip_special_tokens=True)
    stream = tokenizer.stream_decoder(ids[0].tolist())
    assert "".join(stream.push(t) for t in new) + stream.flush() == tokenizer.decode(new)
