"""A model's recommended sampling settings, from generation_config.json or a GGUF file's metadata.

HF folders ship them in generation_config.json (`temperature`, `top_k`, `top_p`, `min_p`,
`repetition_penalty`); llama.cpp's converter copies them into GGUF metadata as `general.sampling.*`
(`temp`, `top_k`, `top_p`, `min_p`, `penalty_repeat`). A generation_config.json next to a .gguf file wins
over its metadata. `kvlab.engine.defaults.resolve_sampling` combines the result with the user's flags.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from kvlab.engine.defaults import SAMPLING_KEYS, ModelSampling
from kvlab.errors import ConfigError

GGUF_KEYS = {"temperature": "general.sampling.temp", "top_k": "general.sampling.top_k",
             "top_p": "general.sampling.top_p", "min_p": "general.sampling.min_p"}
UNSUPPORTED = {"repetition_penalty": "general.sampling.penalty_repeat"}


def _checked(key: str, value: Any, source: str, name: str | None = None) -> Any:
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


def _from_json(path: Path) -> ModelSampling | None:
    from kvlab.hf.loader import read_json

    raw = read_json(path, required=False)
    if raw is None:
        return None
    values = {k: _checked(k, raw[k], str(path)) for k in SAMPLING_KEYS if raw.get(k) is not None}
    ignored = tuple(k for k in UNSUPPORTED if raw.get(k) not in (None, 1, 1.0))
    return ModelSampling(values, path.name, ignored) if values or ignored else None


def _from_gguf(path: Path) -> ModelSampling | None:
    from kvlab.gguf.reader import read_gguf

    metadata = read_gguf(path).metadata
    values = {k: _checked(k, metadata[gguf_key], str(path), gguf_key) for k, gguf_key in GGUF_KEYS.items()
              if metadata.get(gguf_key) is not None}
    ignored = tuple(k for k, gguf_key in UNSUPPORTED.items() if metadata.get(gguf_key) not in (None, 1, 1.0))
    return ModelSampling(values, f"{path.name} general.sampling", ignored) if values or ignored else None


def model_sampling(path: str | Path | None) -> ModelSampling | None:
    """The recommended sampling of the model at `path` (None: the default model), or None if it has none."""
    from kvlab.gguf.loader import gguf_file
    from kvlab.hf.loader import DEFAULT_MODEL_DIR

    if path is None:
        return _from_json(DEFAULT_MODEL_DIR / "generation_config.json")
    found = gguf_file(path)
    if found is None:
        return _from_json(Path(path).expanduser() / "generation_config.json")
    beside = _from_json(found.parent / "generation_config.json")
    return beside if beside is not None else _from_gguf(found)
