"""A ModelConfig from a GGUF file's `{arch}.*` metadata, for the architectures kvlab computes.

The families (qwen3, smollm3, phi3, gemma2, gemma3) are read as llama.cpp reads them: where the converter
writes no key, llama.cpp's own default or rule applies here too (Gemma's attention scale from the shapes,
its sliding-layer pattern, SmolLM3's every-4th-layer NoPE), so a file means what it means to llama.cpp.

The keys are llama.cpp's (`llama.block_count`, `llama.attention.head_count_kv`, ...). Everything the
forward pass needs is read or derived here and then validated by ModelConfig itself, so a GGUF model and
an HF folder go through the same checks. Shapes the metadata implies are checked against the tensors later
(`check_weights`), which is how a file whose metadata and tensors disagree is caught.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from kvlab.config import ModelConfig
from kvlab.errors import ConfigError
from kvlab.gguf.reader import GGUFFile

# general.architecture -> the HF architecture kvlab computes it as
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "smollm3": "SmolLM3ForCausalLM", "phi3": "Phi3ForCausalLM",
                 "gemma3": "Gemma3ForCausalLM", "gemma2": "Gemma2ForCausalLM"}
# llama.cpp's per-architecture rules for what its files leave out (src/models/<arch>.cpp)
SWA_PATTERN = {"gemma2": 2, "gemma3": 6}         # every n-th layer global when no pattern key is given
GEMMA2_WINDOW = 4096                              # gemma2's window when the key is missing
GEMMA2_SOFTCAPS = (50.0, 30.0)                    # llama_hparams' defaults: gemma2 always soft-caps
LARGEST_GEMMA_LAYERS = {"gemma2": 46, "gemma3": 62}  # the 27B models: attention scale from hidden / heads
NO_ROPE_STEP = 4                                  # smollm3: every 4th layer has no RoPE (hard-coded there)


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
    if rotary != head_dim and arch != "phi3":
        raise ConfigError(f"{gguf.path}: metadata '{arch}.rope.dimension_count' ({rotary}) is not the head size "
                          f"({head_dim}); partial rotary embeddings are supported for phi3 only")
    embed = gguf.tensors.get("token_embd.weight")
    tokens = gguf.get("tokenizer.ggml.tokens")
    vocab = gguf.get(f"{arch}.vocab_size")
    if vocab is None:
        vocab = embed.shape[0] if embed is not None and len(embed.shape) == 2 else len(tokens or ())
    window = gguf.get(f"{arch}.attention.sliding_window") if hf_arch == "MistralForCausalLM" else None
    eos = gguf.get("tokenizer.ggml.eos_token_id")
    theta = gguf.number(f"{arch}.rope.freq_base", 10000.0)
    scaling = _rope_scaling(gguf, arch) or _llama3_scaling(gguf, head_dim, theta)
    layers = need("block_count")
    family = _family_fields(gguf, arch, layers, hidden, heads, head_dim, rotary)
    if arch == "phi3":
        scaling = _longrope(gguf, arch, family["partial_rotary_factor"], head_dim) or scaling
        window = gguf.get(f"{arch}.attention.sliding_window") or None  # 0: none (Phi-4)
    try:
        return ModelConfig(
            vocab_size=_uniform(gguf, f"{arch}.vocab_size", vocab),
            hidden_size=hidden,
            intermediate_size=need("feed_forward_length"),
            num_hidden_layers=layers,
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
            hidden_act="gelu_pytorch_tanh" if arch in SWA_PATTERN else "silu",
            **family,
        )
    except ConfigError as exc:
        raise ConfigError(f"{gguf.path}: {exc}") from None


def _family_fields(gguf: GGUFFile, arch: str, layers: int, hidden: int, heads: int, head_dim: int,
                   rotary: Any) -> dict[str, Any]:
    """The families' hooks (kvlab/config.py) as llama.cpp reads the file: its keys, and its defaults and
    hard-coded rules where the converter writes no key (checked against src/models/<arch>.cpp)."""
    fields: dict[str, Any] = {}
    if arch in ("qwen3", "gemma3"):
        fields["qk_norm"] = True
    if arch == "smollm3":
        fields["no_rope_layers"] = tuple(int((i + 1) % NO_ROPE_STEP != 0) for i in range(layers))
    if arch == "phi3":
        if not isinstance(rotary, (int, np.integer)) or isinstance(rotary, bool) or not 0 < rotary <= head_dim:
            raise ConfigError(f"{gguf.path}: metadata 'phi3.rope.dimension_count' must be an integer in "
                              f"1..{head_dim}, got {rotary!r}")
        fields["partial_rotary_factor"] = int(rotary) / head_dim
    if arch not in SWA_PATTERN:
        return fields
    # Gemma: (1 + w) norms (the +1 is taken off the stored weights), sandwich norms, scaled embeddings;
    # no query_pre_attn_scalar key: llama.cpp scales by head_dim^-0.5, or (hidden / heads)^-0.5 for 27B
    large = layers == LARGEST_GEMMA_LAYERS[arch]
    fields.update(norm_weight_offset=1.0, sandwich_norm=True, scale_embeddings=True,
                  query_pre_attn_scalar=float(hidden // heads if large else head_dim))
    caps = GEMMA2_SOFTCAPS if arch == "gemma2" else (None, None)
    attn_cap = gguf.get(f"{arch}.attn_logit_softcapping", caps[0]) if arch == "gemma2" else None
    final_cap = gguf.get(f"{arch}.final_logit_softcapping", caps[1])
    fields.update(attn_logit_softcapping=attn_cap or None, final_logit_softcapping=final_cap or None)
    window = gguf.get(f"{arch}.attention.sliding_window", GEMMA2_WINDOW if arch == "gemma2" else None)
    if window:
        fields["layer_types"] = _layer_types(gguf, arch, layers)
        if "sliding_attention" in fields["layer_types"]:
            fields["interleaved_sliding_window"] = _uniform(gguf, f"{arch}.attention.sliding_window", window)
    base_swa = gguf.get(f"{arch}.rope.freq_base_swa")
    if arch == "gemma3":  # sliding layers: their own base, unscaled (llama.cpp's freq_scale_swa is 1)
        fields["rope_local_base_freq"] = 10000.0 if base_swa is None else float(base_swa)
    elif base_swa is not None and float(base_swa) != gguf.number(f"{arch}.rope.freq_base", 10000.0):
        raise ConfigError(f"{gguf.path}: metadata 'gemma2.rope.freq_base_swa' differs from the global base; "
                          "kvlab rotates every Gemma 2 layer alike")
    return fields


def _layer_types(gguf: GGUFFile, arch: str, layers: int) -> tuple[str, ...]:
    """Which layers slide: `attention.sliding_window_pattern` (a bool per layer, or n: every n-th layer
    global), else llama.cpp's default n (Gemma 3: 6, Gemma 2: 2); layer i slides iff i % n < n - 1."""
    key = f"{arch}.attention.sliding_window_pattern"
    pattern = gguf.get(key, SWA_PATTERN[arch])
    if isinstance(pattern, np.ndarray):
        if pattern.shape != (layers,) or pattern.dtype != np.bool_:
            raise ConfigError(f"{gguf.path}: metadata {key!r} must hold one bool per layer ({layers})")
        sliding = [bool(s) for s in pattern]
    else:
        n = _uniform(gguf, key, pattern)
        sliding = [n == 0 or i % n < n - 1 for i in range(layers)]
    return tuple("sliding_attention" if s else "full_attention" for s in sliding)


def _longrope(gguf: GGUFFile, arch: str, rotary_factor: float, head_dim: int) -> dict[str, Any] | None:
    """Phi-3's LongRoPE from the `rope_factors_long/short` tensors, `rope.scaling.original_context_length`
    and `rope.scaling.attn_factor` (the converter's sqrt(1 + ln(s) / ln(original)) when absent)."""
    long_info, short_info = gguf.tensors.get("rope_factors_long.weight"), gguf.tensors.get("rope_factors_short.weight")
    if long_info is None and short_info is None:
        return None
    pairs = int(head_dim * rotary_factor) // 2
    factors = {}
    for kind, info in (("long_factor", long_info), ("short_factor", short_info)):
        if info is None or info.type_name != "F32" or info.shape != (pairs,):
            raise ConfigError(f"{gguf.path}: tensor 'rope_factors_{kind[:-7]}.weight' must be F32 of shape "
                              f"({pairs},), got {None if info is None else (info.type_name, info.shape)}")
        factors[kind] = [float(f) for f in gguf.raw(info.name).view("<f4")]
    context = _uniform(gguf, f"{arch}.context_length", gguf.get(f"{arch}.context_length", 2048))
    original = _uniform(gguf, f"{arch}.rope.scaling.original_context_length",
                        gguf.get(f"{arch}.rope.scaling.original_context_length", context))
    attention = gguf.get(f"{arch}.rope.scaling.attn_factor")
    if attention is None:
        scale = context / original
        attention = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
    return {"rope_type": "longrope", **factors, "original_max_position_embeddings": original,
            "attention_factor": float(attention)}
