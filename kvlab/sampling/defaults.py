"""Which sampling settings a run uses: the user's flags, else the model's recommendation, else llama.cpp's.

Why: a small instruct model sampled at temperature 0.8 with top-p alone rambles, while the settings its
authors ship in generation_config.json make it answer. vLLM applies those by default; llama.cpp falls back
to temperature 0.8, top_k 40, top_p 0.95, min_p 0.05. Resolution is per setting: a flag always wins; a
setting the model recommends comes next; when the model recommends something, the settings it leaves
out are neutral (temperature 1, filters off: vLLM's defaults fill the rest); when it recommends nothing,
llama.cpp's defaults apply. The result says where each value came from, for the stats line and --verbose.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from kvlab.errors import ConfigError
from kvlab.sampling.sampler import SamplingParams

SAMPLING_KEYS = ("temperature", "top_k", "top_p", "min_p")
UNSUPPORTED = ("repetition_penalty",)  # recommended by some models; kvlab's sampler has no such setting
LLAMA_CPP_DEFAULTS: dict[str, Any] = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}
NEUTRAL: dict[str, Any] = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}


@dataclass(frozen=True)
class ModelSampling:
    """A model's recommended sampling values (a subset of SAMPLING_KEYS) and the file they came from.

    `ignored` lists recommended settings kvlab's sampler does not implement (e.g. repetition_penalty).
    """

    values: dict[str, Any]
    source: str
    ignored: tuple[str, ...] = ()


@dataclass(frozen=True)
class ResolvedSampling:
    """The values to sample with and, per setting, where each came from ("flag", the model's file, ...)."""

    values: dict[str, Any]
    origins: dict[str, str] = field(default_factory=dict)
    ignored: tuple[str, ...] = ()

    def params(self, seed: int | None = None) -> SamplingParams:
        return SamplingParams(seed=seed, **self.values)

    def summary(self) -> str:
        """One short phrase for a stats line, e.g. 'temperature 0.2, top_p 0.9 (generation_config.json)'."""
        if self.values["temperature"] == 0:
            shown = "greedy"
        else:
            parts = [f"temperature {self.values['temperature']:g}"]
            if self.values["top_k"] > 0:
                parts.append(f"top_k {self.values['top_k']}")
            if self.values["top_p"] < 1:
                parts.append(f"top_p {self.values['top_p']:g}")
            if self.values["min_p"] > 0:
                parts.append(f"min_p {self.values['min_p']:g}")
            shown = ", ".join(parts)
        sources = list(dict.fromkeys(self.origins[k] for k in SAMPLING_KEYS))
        return f"{shown} ({' + '.join(sources)})"

    def describe(self) -> str:
        """Every setting with its origin, for --verbose."""
        text = "sampling: " + ", ".join(f"{k}={self.values[k]:g} [{self.origins[k]}]" for k in SAMPLING_KEYS)
        if self.ignored:
            text += f"; not applied (kvlab has no such sampler setting): {', '.join(self.ignored)}"
        return text


def checked_setting(key: str, value: Any, source: str, name: str | None = None) -> Any:
    """The value of sampling setting `key` as the sampler wants it, or a ConfigError naming the file and
    the field (`name`, the file's spelling of the key)."""
    name = name or key
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{source}: {name} must be a number, got {value!r}")
    if key == "top_k":
        if value != int(value):
            raise ConfigError(f"{source}: {name} must be an integer, got {value!r}")
        return max(int(value), 0)  # -1 and 0 both mean off
    ok = {"temperature": value >= 0, "top_p": 0 < value <= 1, "min_p": 0 <= value <= 1}[key]
    if not ok:
        raise ConfigError(f"{source}: {name} {value!r} is out of range")
    return float(value)


def resolve_sampling(flags: Mapping[str, Any], model: ModelSampling | None = None) -> ResolvedSampling:
    """Per setting: the flag (not None), else the model's value, else neutral or llama.cpp's default.

    The result is validated as SamplingParams, so a bad flag or a bad recommendation raises InputError.
    """
    recommended = model.values if model is not None else {}
    base, base_origin = (NEUTRAL, "neutral") if recommended else (LLAMA_CPP_DEFAULTS, "llama.cpp defaults")
    values, origins = {}, {}
    for key in SAMPLING_KEYS:
        if flags.get(key) is not None:
            values[key], origins[key] = flags[key], "flag"
        elif key in recommended:
            values[key], origins[key] = recommended[key], model.source
        else:
            values[key], origins[key] = base[key], base_origin
    resolved = ResolvedSampling(values, origins, model.ignored if model is not None else ())
    resolved.params()  # validate now, before any model work
    return resolved
