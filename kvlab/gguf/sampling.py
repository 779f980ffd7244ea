"""A GGUF file's recommended sampling settings: llama.cpp's converter copies generation_config.json into
metadata as `general.sampling.*` (`temp`, `top_k`, `top_p`, `min_p`, `penalty_repeat`)."""

from __future__ import annotations

from pathlib import Path

from kvlab.gguf.reader import read_gguf
from kvlab.sampling.defaults import ModelSampling, checked_setting

GGUF_KEYS = {"temperature": "general.sampling.temp", "top_k": "general.sampling.top_k",
             "top_p": "general.sampling.top_p", "min_p": "general.sampling.min_p"}
UNSUPPORTED = {"repetition_penalty": "general.sampling.penalty_repeat"}


def from_metadata(path: Path) -> ModelSampling | None:
    """The recommendation in the metadata of the GGUF file at `path`, or None if it recommends nothing."""
    metadata = read_gguf(path).metadata
    values = {k: checked_setting(k, metadata[gguf_key], str(path), gguf_key) for k, gguf_key in GGUF_KEYS.items()
              if metadata.get(gguf_key) is not None}
    ignored = tuple(k for k, gguf_key in UNSUPPORTED.items() if metadata.get(gguf_key) not in (None, 1, 1.0))
    return ModelSampling(values, f"{path.name} general.sampling", ignored) if values or ignored else None
