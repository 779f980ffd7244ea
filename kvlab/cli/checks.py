"""Flag values checked before any work (loading a model, reading stdin), with kvlab.validate's checkers.

Flags left at None (resolved later, e.g. from a model's generation_config.json) are skipped here and are
checked where they are resolved, by SamplingParams itself.
"""

from __future__ import annotations

import argparse
import secrets

from kvlab.sampling.sampler import SamplingParams

SAMPLING_FLAGS = ("temperature", "top_k", "top_p", "min_p", "seed")


def check_sampling_flags(args: argparse.Namespace) -> SamplingParams:
    """SamplingParams of the flags given (InputError naming the bad one); `--seed -1` becomes None."""
    given = {name: getattr(args, name) for name in SAMPLING_FLAGS if getattr(args, name, None) is not None}
    return SamplingParams(**given)


def draw_seed(args: argparse.Namespace) -> bool:
    """`--seed -1` (llama.cpp's "random"): draw a seed now and keep it in `args.seed`, so the command can
    say which one it used and the run can be repeated with `--seed N`. True when one was drawn."""
    if getattr(args, "seed", None) != -1:
        return False
    args.seed = secrets.randbelow(1 << 32)
    return True


def drawn_seed_note(seed: int) -> str:
    return f"seed {seed} (drawn for --seed -1; --seed {seed} repeats this run)"
