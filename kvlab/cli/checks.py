"""Flag values checked before any work (loading a model, reading stdin), with kvlab.validate's checkers.

Flags left at None (resolved later, e.g. from a model's generation_config.json) are skipped here and are
checked where they are resolved, by SamplingParams itself.
"""

from __future__ import annotations

import argparse

from kvlab.sampling.sampler import SamplingParams

SAMPLING_FLAGS = ("temperature", "top_k", "top_p", "min_p", "seed")


def check_sampling_flags(args: argparse.Namespace) -> SamplingParams:
    """SamplingParams of the flags given (InputError naming the bad one); `--seed -1` becomes None."""
    given = {name: getattr(args, name) for name in SAMPLING_FLAGS if getattr(args, name, None) is not None}
    return SamplingParams(**given)
