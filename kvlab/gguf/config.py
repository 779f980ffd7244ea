"""A ModelConfig from a GGUF file's `{arch}.*` metadata, for the architectures kvlab computes.

The keys are llama.cpp's (`llama.block_count`, `llama.attention.head_count_kv`, ...). Everything the
forward pass needs is read or derived here and then validated by ModelConfig itself, so a GGUF model and
an HF folder go through the same checks. Shapes the metadata implies are checked against the tensors later
(`check_weights`), which is how a file whose metadata and tensors disagree is caught.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvlab.config import ModelConfig
from kvlab.errors import ConfigError
from kvlab.gguf.reader import GGUFFile

# general.architecture -> the HF architecture kvlab computes it as
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def architecture_of(gguf: GGUFFile) -> tuple[str, str]:
    """(the file's general.architecture, kvlab's architecture), or a ConfigError listing what is supported."""
    arch = gguf.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ConfigError(f"{gguf.path}: general.architecture {arch!r} is not supported; supported: "
                          + ", ".join(ARCHITECTURES))
    hf_arch = ARCHITECTURES[arch]
    name = str(gguf.get("general.name", "")).lower()
    window = gguf.get(f"{arch}.attention.sliding_window")
    if arch == "llama" and ("mistral" in name or window is not None):
        hf_arch = "MistralForCausalLM"  # llama.cpp stores Mistral as "llama"
    return arch, hf_arch


def _uniform(gguf: GGUFFile, key: str, value: Any) -> int:
    """Per-layer arrays (llama.cpp allows them for head counts) must hold one value here."""
    if isinstance(value, np.ndarray):
        values = set(value.tolist())
        if len(values) != 1:
            raise ConfigError(f"{gguf.path}: metadata {key!r} varies per layer ({sorted(values)}); kvlab needs "
                              "the same value in every layer")
        value = values.pop()
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ConfigError(f"{gguf.path}: metadata {key!r} must be an integer, got {value!r}")
    return int(value)


def _rope_scaling(gguf: GGUFFile, arch: str) -> dict[str, Any] | None:
    kind = gguf.get(f"{arch}.rope.scaling.type", "none")
    if kind in ("none", None):
        return None
    factor = gguf.get(f"{arch}.rope.scaling.factor")
    if kind == "linear":
        if not isinstance(factor, (int, float)) or factor <= 0:
            raise ConfigError(f"{gguf.path}: metadata '{arch}.rope.scaling.factor' must be a positive number "
                              f"for linear scaling, got {factor!r}")
        return None if factor == 1 else {"rope_type": "linear", "factor": float(factor)}
    raise ConfigError(f"{gguf.path}: metadata '{arch}.rope.scaling.type' {kind!r} is not supported (linear)")


def config_from_metadata(gguf: GGUFFile) -> ModelConfig:
    """The model's config; ConfigError names the file and the key when something is missing or unsupported."""
    arch, hf_arch = architecture_of(gguf)

    def need(key: str) -> int:
        full = f"{arch}.{key}"
        if full not in gguf.metadata:
            raise ConfigError(f"{gguf.path}: metadata key {full!r} is missing")
        return _uniform(gguf, full, gguf.metadata[full])

    hidden, heads = need("embedding_length"), need("attention.head_count")
    kv_heads = _uniform(gguf, f"{arch}.attention.head_count_kv",
                        gguf.get(f"{arch}.attention.head_count_kv", heads))
    head_dim = _uniform(gguf, f"{arch}.attention.key_length",
                        gguf.get(f"{arch}.attention.key_length", hidden // max(heads, 1)))
    value_dim = gguf.get(f"{arch}.attention.value_length", head_dim)
    if value_dim != head_dim:
        raise ConfigError(f"{gguf.path}: metadata '{arch}.attention.value_length' ({value_dim}) differs from the "
                          f"key length ({head_dim}); kvlab needs equal head sizes")
    rotary = gguf.get(f"{arch}.rope.dimension_count", head_dim)
    if rotary != head_dim:
        raise ConfigError(f"{gguf.path}: metadata '{arch}.rope.dimension_count' ({rotary}) is not the head size "
                          f"({head_dim}); partial rotary embeddings are not supported")
    embed = gguf.tensors.get("token_embd.weight")
    tokens = gguf.get("tokenizer.ggml.tokens")
    vocab = gguf.get(f"{arch}.vocab_size")
    if vocab is None:
        vocab = embed.shape[0] if embed is not None and len(embed.shape) == 2 else len(tokens or ())
    window = gguf.get(f"{arch}.attention.sliding_window") if hf_arch == "MistralForCausalLM" else None
    eos = gguf.get("tokenizer.ggml.eos_token_id")
    try:
        return ModelConfig(
            vocab_size=_uniform(gguf, f"{arch}.vocab_size", vocab),
            hidden_size=hidden,
            intermediate_size=need("feed_forward_length"),
            num_hidden_layers=need("block_count"),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=gguf.number(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5),
            rope_theta=gguf.number(f"{arch}.rope.freq_base", 10000.0),
            rope_scaling=_rope_scaling(gguf, arch),
            max_position_embeddings=_uniform(gguf, f"{arch}.context_length",
                                             gguf.get(f"{arch}.context_length", 2048)),
            tie_word_embeddings="output.weight" not in gguf.tensors,
            attention_bias="blk.0.attn_q.bias" in gguf.tensors,
            sliding_window=None if window is None else _uniform(gguf, f"{arch}.attention.sliding_window", window),
            bos_token_id=gguf.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=eos,
            architecture=hf_arch,
        )
    except ConfigError as exc:
        raise ConfigError(f"{gguf.path}: {exc}") from None
