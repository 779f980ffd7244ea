"""What each layer of a model keeps in its cache, read from a plain config.json dict: one spec per layer kind.

Why a plain dict: `kvlab memory` sizes architectures kvlab cannot run (Gemma 3, gpt-oss, DeepSeek-V3,
Qwen3-Next, Jamba, Granite-4, Falcon-H1) from config.json alone, and what kvlab runs is sized from the same
specs (kvlab/cache/memory.py: bytes per token and per block), so sizing and allocation cannot disagree.
The kinds follow vLLM's KV-cache specs (vllm/v1/kv_cache_interface.py) and its grouping of equal specs into
KV-cache groups:

- FullAttentionSpec: K and V of every token, `2 * num_kv_heads * head_size` scalars a token (MHA/GQA/MQA).
- SlidingWindowSpec: the same rows, but only the last `sliding_window` tokens: a query at position q sees
  keys q - W < k <= q (transformers' masks; vLLM frees the tokens before `num_computed_tokens - W + 1`).
- MLAAttentionSpec: one latent of `kv_lora_rank + qk_rope_head_dim` scalars a token (DeepSeek V2/V3, Kimi
  K2): no separate K and V, one "head".
- MambaSpec: a constant state per sequence, however long it grows: Mamba-1 (Jamba), Mamba-2 (Granite-4,
  Falcon-H1) and gated delta net (Qwen3-Next's linear attention) conv + recurrent states, with vLLM's
  shapes (model_executor/layers/mamba/mamba_utils.py: the conv state keeps `conv_kernel - 1` columns;
  transformers' caches keep `conv_kernel`, one column more).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from math import prod
from typing import Any, ClassVar, Union

from kvlab import validate
from kvlab.cache.dtypes import FLOAT_NAMES, PAYLOAD_BYTES, scale_bytes_per_row, size_name
from kvlab.config import ModelConfig
from kvlab.errors import ConfigError, InputError


@dataclass(frozen=True)
class FullAttentionSpec:
    """A layer that keeps K and V of every token it has seen."""

    num_kv_heads: int
    head_size: int
    kind: ClassVar[str] = "full_attention"
    rows: ClassVar[int] = 2  # rows of head_size per head and token: K and V

    @property
    def label(self) -> str:
        return self.kind

    def payload_bytes_per_token(self, dtype: object) -> Fraction:
        """Bytes of K/V values one token adds to this layer (int4 is half a byte, so exact)."""
        return self.rows * self.num_kv_heads * self.head_size * PAYLOAD_BYTES[size_name(dtype)]

    def scale_bytes_per_token(self, dtype: object) -> int:
        """int8/int4 scales and zero points one token adds (kvlab/cache/quantized.py); float and fp8: 0."""
        return self.rows * self.num_kv_heads * scale_bytes_per_row(dtype, self.head_size)

    def bytes_per_token(self, dtype: object) -> Fraction:
        return self.payload_bytes_per_token(dtype) + self.scale_bytes_per_token(dtype)

    def tokens_held(self, num_tokens: int) -> int:
        """Tokens this layer holds for a sequence of `num_tokens` (all of them)."""
        return num_tokens

    def blocks_held(self, num_tokens: int, block_size: int) -> int:
        """Blocks of `block_size` tokens this layer holds for the sequence, as a block pool allocates them."""
        return -(-num_tokens // block_size)

    def state_bytes(self, dtype: object) -> int:
        """Bytes kept per sequence whatever its length: none for an attention layer."""
        return 0


@dataclass(frozen=True)
class SlidingWindowSpec(FullAttentionSpec):
    """An attention layer whose queries see only the last `sliding_window` tokens, themselves included."""

    sliding_window: int
    kind: ClassVar[str] = "sliding_attention"

    @property
    def label(self) -> str:
        return f"sliding_attention (window {self.sliding_window})"

    def tokens_held(self, num_tokens: int) -> int:
        """min(tokens, window): while the last token is computed, its query sees the window ending at it.
        (A prefill chunk of n tokens holds up to window - 1 + n while it runs, as vLLM budgets it.)"""
        return min(num_tokens, self.sliding_window)

    def blocks_held(self, num_tokens: int, block_size: int) -> int:
        """vLLM's SlidingWindowManager: before the step that computes token n, the blocks wholly before
        position n - W are freed (get_num_skipped_tokens), so a window that straddles a block boundary
        holds one block more than window / block_size."""
        return -(-num_tokens // block_size) - max(0, num_tokens - self.sliding_window) // block_size


@dataclass(frozen=True)
class MLAAttentionSpec(FullAttentionSpec):
    """Multi-head latent attention: one compressed latent (kv_lora_rank) plus the shared RoPE key
    (qk_rope_head_dim) per token, from which every head's K and V are rebuilt; `num_kv_heads` is 1."""

    kind: ClassVar[str] = "mla"
    rows: ClassVar[int] = 1  # one latent row, not K and V

    @property
    def label(self) -> str:
        return f"mla (latent {self.head_size})"


@dataclass(frozen=True)
class MambaSpec:
    """A layer that keeps a fixed-size state per sequence (a conv window and an SSM/recurrent state), so a
    longer sequence costs it nothing more. `shapes` are vLLM's per-sequence state shapes."""

    shapes: tuple[tuple[int, ...], ...]
    mamba_type: str  # "mamba1", "mamba2" or "gated_delta_net"
    kind: ClassVar[str] = "mamba"

    @property
    def label(self) -> str:
        return {"gated_delta_net": "linear_attention (gated delta net state)"}.get(self.mamba_type,
                                                                                  f"{self.mamba_type} state")

    def payload_bytes_per_token(self, dtype: object) -> Fraction:
        return Fraction(0)

    def scale_bytes_per_token(self, dtype: object) -> int:
        return 0

    def bytes_per_token(self, dtype: object) -> Fraction:
        return Fraction(0)

    def tokens_held(self, num_tokens: int) -> int:
        return 0

    def blocks_held(self, num_tokens: int, block_size: int) -> int:
        return 0

    def state_bytes(self, dtype: object) -> int:
        """Bytes of the state in `dtype` (a float dtype: states are not quantized like K/V rows)."""
        name = size_name(dtype)
        if name not in FLOAT_NAMES:
            raise InputError(f"state dtype must be a float dtype ({', '.join(FLOAT_NAMES)}), got {dtype!r}")
        return sum(prod(shape) for shape in self.shapes) * int(PAYLOAD_BYTES[name])


KVCacheSpec = Union[FullAttentionSpec, SlidingWindowSpec, MLAAttentionSpec, MambaSpec]
LayerSpecs = tuple[tuple[KVCacheSpec, ...], ...]  # per decoder layer, the specs of what it caches


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers whose specs are equal: vLLM allocates them as one KV-cache group."""

    spec: KVCacheSpec
    layers: tuple[int, ...]


def kv_cache_groups(layer_specs: LayerSpecs) -> list[KVCacheGroup]:
    """Group the layers by equal spec, in order of first appearance."""
    members: dict[KVCacheSpec, list[int]] = {}
    for layer, specs in enumerate(layer_specs):
        for spec in specs:
            members.setdefault(spec, []).append(layer)
    return [KVCacheGroup(spec, tuple(layers)) for spec, layers in members.items()]


# Layer-type names in config.json `layer_types` lists and what they cache; "linear_attention" and "mamba"
# are a state whose shape the model family decides (_Fields.state).
LAYER_TYPES = ("full_attention", "attention", "sliding_attention", "linear_attention", "mamba", "hybrid")
# model_type -> (default period of full layers, its config key): every Nth layer is global, the rest slide
_SLIDING_PATTERNS = {"gemma3_text": (6, "sliding_window_pattern"), "gemma3": (6, "sliding_window_pattern"),
                     "cohere2": (4, "sliding_window_pattern"), "gemma2": (2, None), "gpt_oss": (2, None)}
_MAMBA_TYPES = {"jamba": "mamba1", "granitemoehybrid": "mamba2", "falcon_h1": "mamba2",
                "qwen3_next": "gated_delta_net"}


def kv_specs(config: dict[str, Any], source: str = "config.json") -> LayerSpecs:
    """The cache specs of every decoder layer of the model a config.json body describes.

    Reads only the fields sizing needs, so it works for architectures kvlab cannot run; a field it needs
    that is missing or malformed, or a layer type it does not know, is refused naming the field.
    """
    if not isinstance(config, dict):
        raise ConfigError(f"{source}: expected a JSON object, got {type(config).__name__}")
    reader = _Fields(_text_config(config), source)
    return tuple(reader.layer_specs(kind) for kind in reader.layer_types())


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    """A multimodal config's decoder (Gemma 3 4B+: `text_config`), else the config itself."""
    text = config.get("text_config")
    if isinstance(text, dict) and "num_hidden_layers" not in config:
        return {"architectures": config.get("architectures"), **text}
    return config


class _Fields:
    """One config dict, read field by field with errors that name the field."""

    def __init__(self, config: dict[str, Any], source: str) -> None:
        self.config, self.source = config, source
        model_type = config.get("model_type", "")
        self.model_type = model_type if isinstance(model_type, str) else ""
        self.num_layers = self.need("num_hidden_layers", "the layers")
        self.mla = config.get("kv_lora_rank") is not None  # DeepSeek V2/V3, Kimi K2: every attention is MLA

    def need(self, name: str, needed_for: str, default: Any = None, low: int = 1) -> int:
        value = self.config.get(name, default)
        if value is None:
            raise ConfigError(f"{self.source}: missing field {name} (needed to size {needed_for})")
        return validate.int_in_range(value, f"{self.source}: {name}", low, error=ConfigError)

    def layer_types(self) -> list[str]:
        """One of LAYER_TYPES per layer, from `layer_types` or the family's own fields."""
        explicit = self.config.get("layer_types")
        if explicit is not None:
            if not isinstance(explicit, list) or len(explicit) != self.num_layers:
                raise ConfigError(f"{self.source}: layer_types must be a list of {self.num_layers} names "
                                  f"(num_hidden_layers), got {explicit!r}"[:300])
            for i, kind in enumerate(explicit):
                if kind not in LAYER_TYPES:
                    raise ConfigError(f"{self.source}: layer_types[{i}] {kind!r} is not a layer type kvlab "
                                      f"can size (known: {', '.join(LAYER_TYPES)})")
            return list(explicit)
        if self.config.get("linear_attn_config") is not None:
            raise ConfigError(f"{self.source}: linear_attn_config (Kimi Linear's KDA layers) is not a layer "
                              "type kvlab can size")
        count = self.num_layers
        if self.mla:
            return ["full_attention"] * count
        if self.model_type == "qwen3_next":
            every = self.need("full_attention_interval", "Qwen3-Next's layers", default=4)
            return ["linear_attention" if (i + 1) % every else "full_attention" for i in range(count)]
        if self.model_type == "jamba":
            period = self.need("attn_layer_period", "Jamba's layers", default=8)
            offset = self.need("attn_layer_offset", "Jamba's layers", default=4, low=0)
            return ["full_attention" if i % period == offset else "mamba" for i in range(count)]
        if self.model_type == "granitemoehybrid":
            return ["mamba"] * count  # transformers' default when layer_types is absent
        if self.model_type == "falcon_h1":
            return ["hybrid"] * count  # attention and Mamba-2 side by side in every layer
        if self.model_type in _SLIDING_PATTERNS:
            default, key = _SLIDING_PATTERNS[self.model_type]
            every = self.need(key, f"{self.model_type}'s sliding layers", default=default) if key else default
            return ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(count)]
        if self.model_type == "llama" or self.config.get("sliding_window") is None:
            return ["full_attention"] * count
        if "use_sliding_window" in self.config:  # Qwen2/Qwen3: the window is off unless switched on
            if self.config["use_sliding_window"] is not True:
                return ["full_attention"] * count
            first = self.need("max_window_layers", "Qwen's sliding layers", default=28, low=0)
            return ["sliding_attention" if i >= first else "full_attention" for i in range(count)]
        return ["sliding_attention"] * count  # Mistral: one window on every layer

    def layer_specs(self, kind: str) -> tuple[KVCacheSpec, ...]:
        if kind in ("full_attention", "attention") and self.mla:
            width = self.need("kv_lora_rank", "MLA layers") + self.need("qk_rope_head_dim", "MLA layers")
            return (MLAAttentionSpec(1, width),)
        if kind in ("full_attention", "attention"):
            return (self.attention(),)
        if kind == "sliding_attention" and self.mla:
            raise ConfigError(f"{self.source}: a sliding window over MLA latents (kv_lora_rank) is not a layer "
                              "type kvlab can size")
        if kind == "sliding_attention":
            full = self.attention()
            window = self.need("sliding_window", "the sliding layers")
            return (SlidingWindowSpec(full.num_kv_heads, full.head_size, window),)
        if kind == "hybrid":
            return self.attention(), self.state()
        return (self.state(),)  # linear_attention, mamba

    def attention(self) -> FullAttentionSpec:
        head_size = self.config.get("head_dim")
        if head_size is None:
            head_size = self.need("hidden_size", "head_dim = hidden_size / num_attention_heads") \
                // self.need("num_attention_heads", "head_dim = hidden_size / num_attention_heads")
        head_size = validate.int_in_range(head_size, f"{self.source}: head_dim", 1, error=ConfigError)
        kv_heads = self.config.get("num_key_value_heads")
        if kv_heads is None:  # MHA: as many K/V heads as query heads
            kv_heads = self.need("num_attention_heads", "the K/V heads (num_key_value_heads absent)")
        kv_heads = validate.int_in_range(kv_heads, f"{self.source}: num_key_value_heads", 1, error=ConfigError)
        return FullAttentionSpec(kv_heads, head_size)

    def state(self) -> MambaSpec:
        mamba_type = _MAMBA_TYPES.get(self.model_type)
        if mamba_type is None:
            raise ConfigError(f"{self.source}: model_type {self.model_type!r} has linear-attention/Mamba layers "
                              f"whose state kvlab cannot size (known: {', '.join(_MAMBA_TYPES)})")
        if mamba_type == "gated_delta_net":
            what = "Qwen3-Next's linear attention"
            key_heads, key_dim = self.need("linear_num_key_heads", what), self.need("linear_key_head_dim", what)
            value_heads = self.need("linear_num_value_heads", what)
            value_dim = self.need("linear_value_head_dim", what)
            kernel = self.need("linear_conv_kernel_dim", what)
            conv_dim = 2 * key_heads * key_dim + value_heads * value_dim  # q, k and v through the conv
            return MambaSpec(((kernel - 1, conv_dim), (value_heads, value_dim, key_dim)), mamba_type)
        what = f"{self.model_type}'s Mamba layers"
        hidden = self.need("hidden_size", what)
        d_state, kernel = self.need("mamba_d_state", what), self.need("mamba_d_conv", what)
        if mamba_type == "mamba1":
            inner = self.need("mamba_expand", what) * hidden
            return MambaSpec(((kernel - 1, inner), (inner, d_state)), mamba_type)
        inner = self.config.get("mamba_d_ssm")  # Falcon-H1 may give the inner width itself
        inner = self.need("mamba_expand", what) * hidden if inner is None else self.need("mamba_d_ssm", what)
        heads, groups = self.need("mamba_n_heads", what), self.need("mamba_n_groups", what, default=1)
        head_dim = self.config.get("mamba_d_head", "auto")
        head_dim = inner // heads if head_dim == "auto" else self.need("mamba_d_head", what)
        conv_dim = inner + 2 * groups * d_state  # x, B and C through the conv
        return MambaSpec(((kernel - 1, conv_dim), (heads, head_dim, d_state)), mamba_type)


def model_config_specs(config: ModelConfig) -> LayerSpecs:
    """The specs of a model kvlab runs: every layer attends with the same K/V shape, over the window
    `ModelConfig.layer_window` gives it (Mistral's model-wide window, Gemma's sliding layers) or all tokens."""
    full = FullAttentionSpec(config.num_key_value_heads, config.head_dim)
    windows = [config.layer_window(layer) for layer in range(config.num_hidden_layers)]
    return tuple((full if window is None else SlidingWindowSpec(full.num_kv_heads, full.head_size, window),)
                 for window in windows)
