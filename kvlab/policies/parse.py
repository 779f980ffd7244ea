"""Policy names as users type them: `window:W`, `sinks:S:W`, `shift:KEEP[:BUDGET]`, and cache choices that
combine a storage dtype with a policy: `int8`, `int4+sinks:4:60`, `exact`."""

from __future__ import annotations

from dataclasses import dataclass

from kvlab.cache.dtypes import resolve_kv_dtype
from kvlab.errors import InputError
from kvlab.policies.base import Policy
from kvlab.policies.shift import ContextShift
from kvlab.policies.sinks import AttentionSinks
from kvlab.policies.window import SlidingWindow

POLICY_FORMS = ("window:W (keep the last W tokens) | sinks:S:W (the first S plus the last W) | "
                "shift:KEEP[:BUDGET] (llama.cpp context shift; BUDGET defaults to the model's context)")
_KINDS = {"window": (SlidingWindow, 1), "sinks": (AttentionSinks, 2), "shift": (ContextShift, 2)}
# H2O (heavy hitters) was removed: on SmolLM2-135M, sinks:4:60 beat h2o:32:32 at the same 64 tokens over
# 1,024 tokens (+47 % perplexity against +70 %), and its scores needed an attention path of their own
# (README, "Lossy caches, measured").
_REMOVED = {"h2o": "H2O (heavy hitters) was removed: attention sinks beat it at the same memory on "
                   "SmolLM2-135M (README, \"Lossy caches, measured\"); use sinks:S:W"}


def parse_policy(text: str, context: int) -> Policy | None:
    """A Policy for `text`, None for "exact"/"full"/"none"; InputError naming the valid forms otherwise."""
    spec = str(text).strip().lower()
    if spec in ("exact", "full", "none"):
        return None
    kind, *args = spec.split(":")
    if kind in _REMOVED:
        raise InputError(f"cache policy {text!r}: {_REMOVED[kind]}")
    if kind not in _KINDS:
        raise InputError(f"unknown cache policy {text!r}: use exact, {POLICY_FORMS}")
    cls, arity = _KINDS[kind]
    if kind == "shift" and len(args) == 1:
        args.append(str(context))
    if len(args) != arity or not all(args):
        raise InputError(f"cache policy {text!r} needs {arity} number{'s' if arity > 1 else ''}: "
                         f"{POLICY_FORMS}")
    policy = cls(*args)
    if policy.budget > context:
        raise InputError(f"cache policy {text!r} holds {policy.budget} tokens but the model's context is "
                         f"{context} tokens")
    return policy


@dataclass(frozen=True)
class CacheChoice:
    """One entry of `kvlab fidelity`: a storage dtype (None = the compute dtype) and an optional policy."""

    name: str
    kv_dtype: str | None
    policy: Policy | None


def parse_cache_choice(text: str, context: int, compute_dtype: object = "float32") -> CacheChoice:
    """`exact`, a cache dtype (`int8`), a policy (`window:64`), or both joined by `+` (`int8+window:64`)."""
    kv_dtype, policy = None, None
    for part in (p.strip() for p in str(text).split("+")):
        if not part:
            raise InputError(f"empty part in cache choice {text!r}: write DTYPE, POLICY or DTYPE+POLICY")
        if part.split(":")[0].lower() in (*_KINDS, *_REMOVED) or part.lower() in ("exact", "full", "none"):
            found = parse_policy(part, context)
            if found is not None and policy is not None:
                raise InputError(f"{text!r} names two policies; combine one cache dtype with one policy")
            policy = policy or found
        elif kv_dtype is None:
            resolve_kv_dtype(part, compute_dtype)  # InputError naming the dtypes if it is none of them
            kv_dtype = part
        else:
            raise InputError(f"{text!r} names two cache dtypes ({kv_dtype!r} and {part!r})")
    return CacheChoice(str(text).strip(), kv_dtype, policy)
