"""Model configuration with Hugging Face LlamaConfig field names.

Field names match `transformers.LlamaConfig` so a real `config.json` maps onto this dataclass without a
translation table; `from_hf_dict` only resolves the places where HF itself has several spellings (RoPE
settings, Qwen2's sliding-window switch, the dtype key).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from kvlab import validate
from kvlab.errors import ConfigError

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


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

    def __post_init__(self) -> None:
        problems = _problems(self)
        if problems:
            raise ConfigError("invalid model config: " + "; ".join(problems))

    @property
    def num_query_groups(self) -> int:
        """Query heads per KV head (1 = MHA, num_attention_heads = MQA)."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return tuple(self.eos_token_id)

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """Canonical dict (sorted keys when dumped) used for fingerprints and saved caches."""
        return dataclasses.asdict(self)

    def to_hf_dict(self) -> dict[str, Any]:
        """A config.json body that transformers can load."""
        d = {k: v for k, v in self.to_dict().items() if k not in ("architecture", "causal")}
        d["architectures"] = [self.architecture]
        d["model_type"] = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                           "Qwen2ForCausalLM": "qwen2"}[self.architecture]
        d["hidden_act"] = "silu"
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
        arch = archs[0] if archs else {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                                      "qwen2": "Qwen2ForCausalLM"}.get(model_type, "") \
            if isinstance(model_type, str) else ""
        for flag in ("use_sliding_window", "mlp_bias", "tie_word_embeddings", "attention_bias"):
            if raw.get(flag) is not None and not isinstance(raw[flag], bool):
                raise ConfigError(f"{source}: {flag} must be true or false, got {raw[flag]!r}")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(f"{source}: architecture {arch or raw.get('model_type')!r} is not supported; "
                              f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"{source}: hidden_act {act!r} is not supported (only 'silu')")
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if k not in raw]
        if missing:
            raise ConfigError(f"{source}: missing field(s) {', '.join(missing)}")

        theta, scaling = _rope_settings(raw, source)
        window = raw.get("sliding_window")
        if arch == "Qwen2ForCausalLM":
            # Qwen2 hub configs often carry a window that is switched off by use_sliding_window.
            if not raw.get("use_sliding_window", False):
                window = None
            elif raw.get("max_window_layers") not in (None, 0, raw["num_hidden_layers"]) and window:
                raise ConfigError(f"{source}: Qwen2 max_window_layers (per-layer windows) is not supported")
        elif arch == "LlamaForCausalLM":
            window = None
        if raw.get("mlp_bias"):
            raise ConfigError(f"{source}: mlp_bias=true is not supported")
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
                tie_word_embeddings=raw.get("tie_word_embeddings", False),
                attention_bias=raw.get("attention_bias", arch == "Qwen2ForCausalLM"),
                sliding_window=window,
                bos_token_id=raw.get("bos_token_id"),
                eos_token_id=raw.get("eos_token_id"),
                architecture=arch,
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
    return problems


def _rope_scaling_problems(scaling: Any) -> list[str]:
    """The RoPE scaling dict's problems: a known type and positive, finite factors (0 would give NaN)."""
    if scaling is None:
        return []
    if not isinstance(scaling, dict):
        return [f"rope_scaling must be an object or null, got {scaling!r}"]
    kind = scaling.get("rope_type", "default")
    if kind not in ("default", "linear", "llama3"):
        return [f"rope_scaling type {kind!r} is not supported (default, linear, llama3)"]
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


def _rope_settings(raw: dict[str, Any], source: str) -> tuple[Any, dict[str, Any] | None]:
    """Resolve RoPE theta and scaling from the three spellings transformers has used.

    5.x: `rope_parameters: {rope_theta, rope_type, ...}`; 4.x: top-level `rope_theta` plus `rope_scaling`
    whose kind is under `rope_type` (newer) or `type` (older).
    """
    params = raw.get("rope_parameters")
    if params is not None and not isinstance(params, dict):
        raise ConfigError(f"{source}: rope_parameters must be an object, got {params!r}")
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
    kind = scaling.get("rope_type", "default")
    if kind == "default":
        return theta, None
    if kind not in ("linear", "llama3"):
        raise ConfigError(f"{source}: rope type {kind!r} is not supported (default, linear, llama3)")
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
