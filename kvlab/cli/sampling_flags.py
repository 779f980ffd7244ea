"""The sampling flags of `generate` and `chat`, and their resolution against the model's recommendation.

The flags default to None ("not given"), so `kvlab.sampling.defaults.resolve_sampling` can tell a flag from
a default: flags win, then the model's generation_config.json (or GGUF `general.sampling.*`), then
llama.cpp's defaults.
"""

from __future__ import annotations

import argparse
from typing import Any

from kvlab.sampling.defaults import SAMPLING_KEYS, ResolvedSampling, resolve_sampling

SAMPLING_HELP = ("unset sampling flags take the model's generation_config.json values, else llama.cpp's "
                 "defaults (temperature 0.8, top_k 40, top_p 0.95, min_p 0.05)")


def add_sampling_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", "--temp", type=float, default=None, help="0 = greedy; " + SAMPLING_HELP)
    p.add_argument("--top-p", type=float, default=None, help="nucleus mass, 1.0 = off")
    p.add_argument("--top-k", type=int, default=None, help="0 or -1 = off")
    p.add_argument("--min-p", type=float, default=None, help="0.0 = off")
    p.add_argument("-v", "--verbose", action="store_true", help="say which sampling settings are used, and why")


def sampling_settings(args: argparse.Namespace, model_path: Any, model_known: bool = True) -> ResolvedSampling:
    """The flags over the recommendation of the model at `model_path` (None: the default model).

    A bad flag fails before any model file is read. `model_known=False` (e.g. chat's random TinyLlama)
    skips the model's files.
    """
    from kvlab.loader import model_sampling

    flags = {key: getattr(args, key) for key in SAMPLING_KEYS}
    resolve_sampling(flags)
    return resolve_sampling(flags, model_sampling(model_path) if model_known else None)
