"""A model's recommended sampling settings from an HF folder's generation_config.json.

HF folders ship them as `temperature`, `top_k`, `top_p`, `min_p`, `repetition_penalty`; GGUF files carry
them in metadata (kvlab/gguf/sampling.py). `kvlab.loader.model_sampling` picks the source for a path and
`kvlab.sampling.defaults.resolve_sampling` combines the result with the user's flags.
"""

from __future__ import annotations

from pathlib import Path

from kvlab.sampling.defaults import SAMPLING_KEYS, UNSUPPORTED, ModelSampling, checked_setting


def from_json(path: Path) -> ModelSampling | None:
    """The recommendation in a generation_config.json, or None if it is absent or recommends nothing."""
    from kvlab.hf.loader import read_json

    raw = read_json(path, required=False)
    if raw is None:
        return None
    values = {k: checked_setting(k, raw[k], str(path)) for k in SAMPLING_KEYS if raw.get(k) is not None}
    ignored = tuple(k for k in UNSUPPORTED if raw.get(k) not in (None, 1, 1.0))
    return ModelSampling(values, path.name, ignored) if values or ignored else None


