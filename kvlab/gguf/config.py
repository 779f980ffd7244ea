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


LLAMA3_STANDARD = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def llama3_factors(head_dim: int, theta: float, factor: float, low: float, high: float, old: float) -> np.ndarray:
    """llama.cpp's `rope_freqs` for Llama 3 scaling: each frequency is divided by its factor (1 for short
    wavelengths, `factor` for long ones, a smooth blend between), as HF's "llama3" rope computes."""
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / freqs
    smooth = (old / wavelen - low) / (high - low)
    blended = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < old / high, 1.0, np.where(wavelen > old / low, factor, blended))


def _llama3_scaling(gguf: GGUFFile, head_dim: int, theta: float) -> dict[str, Any] | None:
    """HF's llama3 rope_scaling recovered from the `rope_freqs.weight` tensor llama.cpp writes for Llama 3.

    The tensor holds per-frequency factors, not the parameters; they depend only on the ratios of
    (original context, low, high), so the standard Llama 3 values are tried first, else the ratios are
    fitted from the blended band. Either way the result must reproduce every factor, or ConfigError.
    """
    info = gguf.tensors.get("rope_freqs.weight")
    if info is None:
        return None
    if info.type_name != "F32" or info.shape != (head_dim // 2,):
        raise ConfigError(f"{gguf.path}: tensor 'rope_freqs.weight' must be F32 of shape ({head_dim // 2},), got "
                          f"{info.type_name} {info.shape}")
    factors = gguf.raw(info.name).view("<f4").astype(np.float64)
    factor = float(factors.max())
    if np.all(factors == 1.0):
        return None
    candidates = [LLAMA3_STANDARD]
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    band = (factors > 1.0 + 1e-6) & (factors < factor - 1e-6)
    if band.sum() >= 2:  # smooth = old / wavelen / (high - low) - low / (high - low): a line in 1 / wavelen
        smooth = (1 / factors[band] - 1 / factor) / (1 - 1 / factor)
        slope, intercept = np.polyfit(freqs[band] / (2 * np.pi), smooth, 1)
        low = -intercept
        if low > 0 and slope > 0:  # only ratios are fixed: scale so the original context is a whole number
            old = max(1, int(round(slope / low)))
            candidates.append({"low_freq_factor": old * low / slope, "high_freq_factor": old * (low + 1.0) / slope,
                               "original_max_position_embeddings": old})
    for params in candidates:
        want = llama3_factors(head_dim, theta, factor, params["low_freq_factor"], params["high_freq_factor"],
                              params["original_max_position_embeddings"])
        if np.allclose(want, factors, rtol=1e-5, atol=0):
            return {"rope_type": "llama3", "factor": factor, "low_freq_factor": float(params["low_freq_factor"]),
                    "high_freq_factor": float(params["high_freq_factor"]),
                    "original_max_position_embeddings": int(params["original_max_position_embeddings"])}
    raise ConfigError(f"{gguf.path}: tensor 'rope_freqs.weight' does not follow Llama 3 rope scaling; kvlab "
                      "cannot compute these per-frequency factors")


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
    theta = gguf.number(f"{arch}.rope.freq_base", 10000.0)
    scaling = _rope_scaling(gguf, arch) or _llama3_scaling(gguf, head_dim, theta)
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
            rope_theta=theta,
            rope_scaling=scaling,
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
