"""Model configuration with Hugging Face LlamaConfig field names.

Field names match `transformers.LlamaConfig` so a real `config.json` maps onto this dataclass without a
translation table; `from_hf_dict` only resolves the places where HF itself has several spellings (RoPE
settings, Qwen2's sliding-window switch, the dtype key). The other families (Qwen3, SmolLM3, Phi-3, Gemma 2
and 3) are the same decoder with a few named hooks, each a field here with the HF name where HF has one:
q/k norms, Gemma's `(1 + w)` norms and its norms after attention and MLP, GeGLU, the embedding scale, the
attention scale (`query_pre_attn_scalar`), soft-capping, per-layer windows (`layer_types`), per-layer RoPE
(`rope_local_base_freq`, `no_rope_layers`), partial rotary and LongRoPE. `_family_fields` reads each
family's config.json into them; every default is Llama's, so a Llama config is unchanged.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

from kvlab import validate
from kvlab.errors import ConfigError

# architecture -> model_type (config.json's, for to_hf_dict and configs without "architectures")
MODEL_TYPES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
               "Qwen3ForCausalLM": "qwen3", "SmolLM3ForCausalLM": "smollm3", "Phi3ForCausalLM": "phi3",
               "Gemma3ForCausalLM": "gemma3_text", "Gemma2ForCausalLM": "gemma2"}
SUPPORTED_ARCHITECTURES = tuple(MODEL_TYPES)
GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
LAYER_TYPES = ("full_attention", "sliding_attention")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The shape and numerics of a Llama-family decoder.

    `rope_scaling` keeps HF's dict form (`{"rope_type": "llama3", "factor": 8.0, ...}`) or None.
    `sliding_window` is the *effective* window (None = full attention): a query at position q sees keys k
    with q - W < k <= q. `causal=False` exists only for the verifier's negative control.
    """

    vocab_size: int = 260
    hidden_size: int = 32
    intermediate_size: int = 96
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    architecture: str = "LlamaForCausalLM"
    causal: bool = True
    # --- the families' hooks (defaults: Llama) -------------------------------------------------------------
    hidden_act: str = "silu"                      # "gelu_pytorch_tanh": Gemma's GeGLU
    qk_norm: bool = False                         # Qwen3, Gemma 3: RMSNorm per head on q and k before RoPE
    norm_weight_offset: float = 0.0               # Gemma: RMSNorm scales by (offset + w), offset 1
    sandwich_norm: bool = False                   # Gemma: norms after attention and after the MLP too
    scale_embeddings: bool = False                # Gemma: embeddings times sqrt(hidden_size)
    query_pre_attn_scalar: float | None = None    # Gemma: attention scale query_pre_attn_scalar^-0.5
    attn_logit_softcapping: float | None = None   # Gemma 2: scores -> cap * tanh(scores / cap)
    final_logit_softcapping: float | None = None  # Gemma 2: logits -> cap * tanh(logits / cap)
    layer_types: tuple[str, ...] | None = None    # per layer "sliding_attention" / "full_attention"
    interleaved_sliding_window: int | None = None  # the window of the sliding layers of `layer_types`
    rope_local_base_freq: float | None = None     # Gemma 3: RoPE theta of sliding layers (no scaling there)
    no_rope_layers: tuple[int, ...] | None = None  # SmolLM3: per layer 1 = RoPE, 0 = none (NoPE)
    partial_rotary_factor: float = 1.0            # Phi-3/4: RoPE on the first fraction of each head

    # fields left out of to_dict when they hold their default, so a Llama's fingerprint is unchanged
    _HOOKS = ("hidden_act", "qk_norm", "norm_weight_offset", "sandwich_norm", "scale_embeddings",
              "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping", "layer_types",
              "interleaved_sliding_window", "rope_local_base_freq", "no_rope_layers", "partial_rotary_factor")

    def __post_init__(self) -> None:
        problems = _problems(self)
        if problems:
            raise ConfigError("invalid model config: " + "; ".join(problems))

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return tuple(self.eos_token_id)

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    # --- per-layer hooks ------------------------------------------------------------------------------------
    def layer_window(self, layer: int) -> int | None:
        """The window of `layer` (None: it sees every earlier key): the model-wide `sliding_window`, or
        `interleaved_sliding_window` on the sliding layers of `layer_types`."""
        if self.layer_types is not None and self.layer_types[layer] == "sliding_attention":
            return self.interleaved_sliding_window
        return self.sliding_window

    def layer_rope(self, layer: int) -> str:
        """Which rotation `layer` takes: "global" (rope_theta and rope_scaling), "local" (Gemma 3's sliding
        layers: rope_local_base_freq, unscaled) or "none" (SmolLM3's NoPE layers)."""
        if self.no_rope_layers is not None and not self.no_rope_layers[layer]:
            return "none"
        if self.rope_local_base_freq is not None and self.layer_window(layer) is not None:
            return "local"
        return "global"

    @property
    def rotary_dim(self) -> int:
        """Channels of each head that RoPE rotates (the first ones; Phi-4-mini: 3/4 of the head)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def attention_scale(self) -> float:
        """What q.k is multiplied by before the softmax: 1/sqrt(head_dim), or query_pre_attn_scalar^-0.5."""
        return (self.query_pre_attn_scalar if self.query_pre_attn_scalar is not None else self.head_dim) ** -0.5

    @property
    def hybrid(self) -> bool:
        """Whether some layers slide and others attend to everything (Gemma): one window does not fit all."""
        return self.layer_types is not None and len(set(self.layer_types)) > 1

    def to_dict(self) -> dict[str, Any]:
        """Canonical dict (sorted keys when dumped) used for fingerprints and saved caches; the families'
        hooks appear only where they differ from Llama's."""
        d = dataclasses.asdict(self)
        defaults = ModelConfig.__dataclass_fields__
        for name in self._HOOKS:
            if d[name] == defaults[name].default:
                del d[name]
            elif isinstance(d[name], tuple):
                d[name] = list(d[name])
        return d

    def to_hf_dict(self) -> dict[str, Any]:
        """A config.json body that transformers can load (the families' fields under their HF names)."""
        d = {k: v for k, v in self.to_dict().items() if k not in ("architecture", "causal") + self._HOOKS}
        d["architectures"] = [self.architecture]
        d["model_type"] = MODEL_TYPES[self.architecture]
        d["hidden_act"] = self.hidden_act
        if self.architecture in GEMMA:
            d["hidden_activation"] = self.hidden_act
            scalar = self.query_pre_attn_scalar  # transformers' Gemma configs require an int where it is one
            d["query_pre_attn_scalar"] = int(scalar) if scalar is not None and scalar.is_integer() else scalar
            d["attn_logit_softcapping"] = self.attn_logit_softcapping
            d["final_logit_softcapping"] = self.final_logit_softcapping
        if self.layer_types is not None:
            d["layer_types"] = list(self.layer_types)
            d["sliding_window"] = self.interleaved_sliding_window
        if self.rope_local_base_freq is not None:
            d["rope_local_base_freq"] = self.rope_local_base_freq
        if self.no_rope_layers is not None:
            d["no_rope_layers"] = list(self.no_rope_layers)
        if self.partial_rotary_factor != 1.0:
            d["partial_rotary_factor"] = self.partial_rotary_factor
        if self.rope_scaling and self.rope_scaling.get("rope_type") == "longrope":
            d["original_max_position_embeddings"] = self.rope_scaling["original_max_position_embeddings"]
        return d

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        """Build from a transformers config.json body (4.x and 5.x spellings)."""
        if not isinstance(raw, dict):
            raise ConfigError(f"{source}: expected a JSON object, got {type(raw).__name__}")
        archs = raw.get("architectures") or []
        if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
            raise ConfigError(f"{source}: architectures must be a list of names, got {archs!r}")
        model_type = raw.get("model_type", "")
        by_type = {t: a for a, t in MODEL_TYPES.items()}
        arch = archs[0] if archs else by_type.get(model_type, "") if isinstance(model_type, str) else ""
        for flag in ("use_sliding_window", "mlp_bias", "tie_word_embeddings", "attention_bias"):
            if raw.get(flag) is not None and not isinstance(raw[flag], bool):
                raise ConfigError(f"{source}: {flag} must be true or false, got {raw[flag]!r}")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(f"{source}: architecture {arch or raw.get('model_type')!r} is not supported; "
                              f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        act = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh" if arch in GEMMA \
            else raw.get("hidden_act", "silu")
        if act not in ACTIVATIONS:
            raise ConfigError(f"{source}: hidden_act {act!r} is not supported ({', '.join(ACTIVATIONS)})")
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if k not in raw]
        if missing:
            raise ConfigError(f"{source}: missing field(s) {', '.join(missing)}")

        theta, scaling = _rope_settings(raw, source)
        window = raw.get("sliding_window")
        if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "SmolLM3ForCausalLM"):
            # Qwen hub configs often carry a window that is switched off by use_sliding_window.
            if not raw.get("use_sliding_window", False):
                window = None
            elif arch != "Qwen2ForCausalLM" and window:
                raise ConfigError(f"{source}: use_sliding_window=true is not supported for {arch}")
            elif raw.get("max_window_layers") not in (None, 0, raw["num_hidden_layers"]) and window:
                raise ConfigError(f"{source}: Qwen2 max_window_layers (per-layer windows) is not supported")
        elif arch == "LlamaForCausalLM":
            window = None
        if raw.get("mlp_bias"):
            raise ConfigError(f"{source}: mlp_bias=true is not supported")
        family = _family_fields(raw, arch, source)
        if "layer_types" in family:
            window = None  # the window belongs to the sliding layers only: interleaved_sliding_window
        if scaling is not None and scaling.get("rope_type") == "longrope":
            scaling = _longrope(raw, scaling, source)
        try:
            return cls(
                vocab_size=raw["vocab_size"],
                hidden_size=raw["hidden_size"],
                intermediate_size=raw["intermediate_size"],
                num_hidden_layers=raw["num_hidden_layers"],
                num_attention_heads=raw["num_attention_heads"],
                num_key_value_heads=raw["num_attention_heads"] if raw.get("num_key_value_heads") is None
                else raw["num_key_value_heads"],
                head_dim=raw.get("head_dim"),
                rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
                rope_theta=theta,
                rope_scaling=scaling,
                max_position_embeddings=raw.get("max_position_embeddings", 2048),
                tie_word_embeddings=raw.get("tie_word_embeddings", arch in GEMMA + ("SmolLM3ForCausalLM",)),
                attention_bias=raw.get("attention_bias", arch == "Qwen2ForCausalLM"),
                sliding_window=window,
                bos_token_id=raw.get("bos_token_id"),
                eos_token_id=raw.get("eos_token_id"),
                architecture=arch,
                hidden_act=act,
                **family,
            )
        except ConfigError as exc:
            raise ConfigError(f"{source}: {exc}") from None

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        """Read a config.json, or the config.json inside a model folder."""
        path = validate.existing_path(path, "config file or model folder", kind="any", error=ConfigError)
        if path.is_dir():
            path = path / "config.json"
        raw = validate.read_json_object(path, "config file", error=ConfigError)
        return cls.from_hf_dict(raw, source=str(path))


def _family_fields(raw: dict[str, Any], arch: str, source: str) -> dict[str, Any]:
    """The hooks of `arch` from its config.json (HF's names and its older spellings)."""
    layers = raw["num_hidden_layers"]
    fields: dict[str, Any] = {}
    if arch in ("Qwen3ForCausalLM", "Gemma3ForCausalLM"):
        fields["qk_norm"] = True
    if arch == "SmolLM3ForCausalLM":
        rope_layers = raw.get("no_rope_layers")
        if rope_layers is None:
            interval = raw.get("no_rope_layer_interval", 4)
            if not isinstance(interval, int) or isinstance(interval, bool) or interval < 1:
                raise ConfigError(f"{source}: no_rope_layer_interval must be an integer >= 1, got {interval!r}")
            rope_layers = [int((i + 1) % interval != 0) for i in range(layers)]
        fields["no_rope_layers"] = rope_layers
    if arch == "Phi3ForCausalLM":
        params = raw.get("rope_parameters") if isinstance(raw.get("rope_parameters"), dict) else {}
        fields["partial_rotary_factor"] = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if arch in GEMMA:
        fields.update(norm_weight_offset=1.0, sandwich_norm=True, scale_embeddings=True,
                      query_pre_attn_scalar=raw.get("query_pre_attn_scalar", raw.get("head_dim")),
                      attn_logit_softcapping=raw.get("attn_logit_softcapping"),
                      final_logit_softcapping=raw.get("final_logit_softcapping"))
        types = raw.get("layer_types")
        if types is None:  # older configs: every pattern-th layer is global (Gemma 2: every other one)
            pattern = raw.get("sliding_window_pattern", raw.get("_sliding_window_pattern",
                                                                6 if arch == "Gemma3ForCausalLM" else 2))
            if not isinstance(pattern, int) or isinstance(pattern, bool) or pattern < 1:
                raise ConfigError(f"{source}: sliding_window_pattern must be an integer >= 1, got {pattern!r}")
            types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
        fields["layer_types"] = types
        if "sliding_attention" in types:
            if raw.get("sliding_window") is None:
                raise ConfigError(f"{source}: layer_types has sliding layers but sliding_window is missing")
            fields["interleaved_sliding_window"] = raw["sliding_window"]
        if arch == "Gemma3ForCausalLM":
            params = raw.get("rope_parameters")
            local = params.get("sliding_attention", {}).get("rope_theta") if isinstance(params, dict) else None
            fields["rope_local_base_freq"] = local if local is not None else raw.get("rope_local_base_freq", 10000.0)
    return fields


def _longrope(raw: dict[str, Any], scaling: dict[str, Any], source: str) -> dict[str, Any]:
    """LongRoPE's canonical form: both factor lists, the pretraining length and the attention factor,
    resolved as transformers does (factor = max_position_embeddings / original when not given)."""
    original = scaling.get("original_max_position_embeddings", raw.get("original_max_position_embeddings"))
    for key in ("short_factor", "long_factor"):
        if not isinstance(scaling.get(key), list):
            raise ConfigError(f"{source}: longrope rope scaling needs a list {key!r}")
    if not isinstance(original, int) or isinstance(original, bool) or original < 1:
        raise ConfigError(f"{source}: longrope rope scaling needs original_max_position_embeddings (an integer "
                          f">= 1), got {original!r}")
    factor = scaling.get("factor") or raw.get("max_position_embeddings", 2048) / original
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return {"rope_type": "longrope", "short_factor": list(scaling["short_factor"]),
            "long_factor": list(scaling["long_factor"]), "original_max_position_embeddings": original,
            "attention_factor": attention}


def _problems(config: ModelConfig) -> list[str]:
    """Every invalid field of `config`, named; canonical types (float, dict) are stored back as it goes.

    Each field is checked for its type as well as its range: a config.json that says
    `"tie_word_embeddings": "false"` or `"rope_theta": 0` must be refused, not read as true or turned into
    NaN logits. Uses kvlab.validate's checkers, so the messages match the rest of kvlab.
    """
    problems: list[str] = []

    def check(name: str, checker: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            value = checker(getattr(config, name), name, *args, error=ConfigError, **kwargs)
        except ConfigError as exc:
            problems.append(str(exc))
            return None
        object.__setattr__(config, name, value)
        return value

    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "max_position_embeddings"):
        check(name, validate.int_in_range, 1)
    if config.head_dim is None and not problems:
        object.__setattr__(config, "head_dim", config.hidden_size // config.num_attention_heads)
    if config.head_dim is not None:
        check("head_dim", validate.int_in_range, 1)
    if not problems and config.num_attention_heads % config.num_key_value_heads:
        problems.append(f"num_attention_heads ({config.num_attention_heads}) must be a multiple of "
                        f"num_key_value_heads ({config.num_key_value_heads})")
    if not problems and config.head_dim % 2:
        problems.append(f"head_dim must be even for RoPE, got {config.head_dim}")
    check("rms_norm_eps", validate.positive_float)
    check("rope_theta", validate.positive_float)
    problems += _rope_scaling_problems(config.rope_scaling)
    for name in ("tie_word_embeddings", "attention_bias", "causal"):
        if not isinstance(getattr(config, name), bool):
            problems.append(f"{name} must be true or false, got {getattr(config, name)!r}")
    if config.sliding_window is not None:
        check("sliding_window", validate.int_in_range, 1)
    if config.bos_token_id is not None:
        check("bos_token_id", validate.int_in_range, 0)
    eos = config.eos_token_id
    if eos is not None and not (isinstance(eos, list) and eos and all(validate.is_int(t) for t in eos)):
        check("eos_token_id", validate.int_in_range, 0)
    elif eos is not None and min(eos) < 0:
        problems.append(f"eos_token_id must be ids >= 0, got {eos!r}")
    if config.architecture not in SUPPORTED_ARCHITECTURES:
        problems.append(f"architecture {config.architecture!r} is not supported; supported: "
                        + ", ".join(SUPPORTED_ARCHITECTURES))
    if not problems:
        problems += _hook_problems(config)
    return problems


def _hook_problems(config: ModelConfig) -> list[str]:
    """The families' fields: types, ranges, one entry per layer; tuples stored back for lists."""
    problems: list[str] = []
    layers = config.num_hidden_layers
    if config.hidden_act not in ACTIVATIONS:
        problems.append(f"hidden_act must be one of {', '.join(ACTIVATIONS)}, got {config.hidden_act!r}")
    for name in ("qk_norm", "sandwich_norm", "scale_embeddings"):
        if not isinstance(getattr(config, name), bool):
            problems.append(f"{name} must be true or false, got {getattr(config, name)!r}")
    for name in ("norm_weight_offset",):
        if not validate.is_real(getattr(config, name)) or not math.isfinite(getattr(config, name)):
            problems.append(f"{name} must be a finite number, got {getattr(config, name)!r}")
    for name in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
                 "rope_local_base_freq"):
        value = getattr(config, name)
        if value is not None:
            try:
                object.__setattr__(config, name, validate.positive_float(value, name, error=ConfigError))
            except ConfigError as exc:
                problems.append(str(exc))
    types = config.layer_types
    if types is not None:
        if not isinstance(types, (list, tuple)) or len(types) != layers or any(t not in LAYER_TYPES for t in types):
            problems.append(f"layer_types must list one of {', '.join(LAYER_TYPES)} per layer ({layers}), got "
                            f"{types!r}")
        else:
            object.__setattr__(config, "layer_types", tuple(types))
            if "sliding_attention" in types and config.interleaved_sliding_window is None:
                problems.append("layer_types has sliding layers but interleaved_sliding_window is not set")
            if config.sliding_window is not None:
                problems.append("sliding_window (every layer's window) and layer_types cannot both be set")
    if config.interleaved_sliding_window is not None:
        try:
            validate.int_in_range(config.interleaved_sliding_window, "interleaved_sliding_window", 1,
                                  error=ConfigError)
        except ConfigError as exc:
            problems.append(str(exc))
    rope_layers = config.no_rope_layers
    if rope_layers is not None:
        if not isinstance(rope_layers, (list, tuple)) or len(rope_layers) != layers or any(
                r not in (0, 1) or isinstance(r, bool) for r in rope_layers):
            problems.append(f"no_rope_layers must hold 0 or 1 per layer ({layers}), got {rope_layers!r}")
        else:
            object.__setattr__(config, "no_rope_layers", tuple(int(r) for r in rope_layers))
    factor = config.partial_rotary_factor
    if not validate.is_real(factor) or not 0 < factor <= 1:
        problems.append(f"partial_rotary_factor must be in (0, 1], got {factor!r}")
    elif config.rotary_dim % 2 or (config.head_dim - config.rotary_dim) % 2 or not config.rotary_dim:
        problems.append(f"partial_rotary_factor {factor} rotates {config.rotary_dim} of {config.head_dim} "
                        "channels: both parts must be even and the rotated one non-empty")
    scaling = config.rope_scaling
    if isinstance(scaling, dict) and scaling.get("rope_type") == "longrope" and not problems:
        for key in ("short_factor", "long_factor"):
            if len(scaling[key]) != config.rotary_dim // 2:
                problems.append(f"rope_scaling.{key} has {len(scaling[key])} factors; the rotary dim "
                                f"{config.rotary_dim} needs {config.rotary_dim // 2}")
    return problems


def _rope_scaling_problems(scaling: Any) -> list[str]:
    """The RoPE scaling dict's problems: a known type and positive, finite factors (0 would give NaN)."""
    if scaling is None:
        return []
    if not isinstance(scaling, dict):
        return [f"rope_scaling must be an object or null, got {scaling!r}"]
    kind = scaling.get("rope_type", "default")
    if kind == "longrope":
        return _longrope_problems(scaling)
    if kind not in ("default", "linear", "llama3"):
        return [f"rope_scaling type {kind!r} is not supported (default, linear, llama3, longrope)"]
    problems = []
    keys = {"linear": ("factor",), "default": (),
            "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
    for key in keys[kind]:
        try:
            if key == "original_max_position_embeddings":
                validate.int_in_range(scaling.get(key), f"rope_scaling.{key}", 1, error=ConfigError)
            else:
                validate.positive_float(scaling.get(key), f"rope_scaling.{key}", error=ConfigError)
        except ConfigError as exc:
            problems.append(str(exc))
    if kind == "llama3" and not problems and scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
        problems.append("rope_scaling.high_freq_factor must be > low_freq_factor (llama3 smooths between them)")
    return problems


def _longrope_problems(scaling: dict[str, Any]) -> list[str]:
    problems = []
    for key in ("short_factor", "long_factor"):
        factors = scaling.get(key)
        if not isinstance(factors, (list, tuple)) or not factors or not all(
                validate.is_real(f) and math.isfinite(f) and f > 0 for f in factors):
            problems.append(f"rope_scaling.{key} must be a list of positive numbers, got {factors!r}")
    try:
        validate.int_in_range(scaling.get("original_max_position_embeddings"),
                              "rope_scaling.original_max_position_embeddings", 1, error=ConfigError)
        validate.positive_float(scaling.get("attention_factor"), "rope_scaling.attention_factor", error=ConfigError)
    except ConfigError as exc:
        problems.append(str(exc))
    return problems


def _rope_settings(raw: dict[str, Any], source: str) -> tuple[Any, dict[str, Any] | None]:
    """Resolve RoPE theta and scaling from the three spellings transformers has used.

    5.x: `rope_parameters: {rope_theta, rope_type, ...}`; 4.x: top-level `rope_theta` plus `rope_scaling`
    whose kind is under `rope_type` (newer) or `type` (older).
    """
    params = raw.get("rope_parameters")
    if params is not None and not isinstance(params, dict):
        raise ConfigError(f"{source}: rope_parameters must be an object, got {params!r}")
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
        params = params["full_attention"]  # per layer type (Gemma 3): the global layers' rotation
    if isinstance(params, dict):
        theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = raw.get("rope_theta", 10000.0)
        scaling = raw.get("rope_scaling") or {}
        if not isinstance(scaling, dict):
            raise ConfigError(f"{source}: rope_scaling must be an object or null, got {scaling!r}")
        scaling = dict(scaling)
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    scaling.pop("partial_rotary_factor", None)  # a field of its own (Phi-3)
    if scaling.get("rope_type") == "su":  # LongRoPE's first name
        scaling["rope_type"] = "longrope"
    kind = scaling.get("rope_type", "default")
    if kind == "default":
        return theta, None
    if kind == "longrope":
        return theta, scaling  # resolved by _longrope, which needs the whole config
    if kind not in ("linear", "llama3"):
        raise ConfigError(f"{source}: rope type {kind!r} is not supported (default, linear, llama3, longrope)")
    if "factor" not in scaling:
        raise ConfigError(f"{source}: rope scaling {kind!r} needs a 'factor'")
    if kind == "llama3":
        for key in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            if key not in scaling:
                raise ConfigError(f"{source}: llama3 rope scaling needs {key!r}")
    return theta, scaling


def tiny_config(**changes: Any) -> ModelConfig:
    """The seeds' model: 2 layers, hidden 32, 4 query heads, 2 KV heads, head_dim 8.

    vocab 260 = 256 byte tokens + <bos> 256, <eos> 257, <pad> 258, one spare; intermediate 96 (3x hidden,
    the usual SwiGLU ratio rounded to a multiple of 32).
    """
    base = ModelConfig(bos_token_id=256, eos_token_id=257)
    return base.replace(**changes) if changes else base
