"""The verifier: cached logits against a full recompute, over schedules that stress the cache.

Every schedule feeds the same supplied tokens two ways: once as one full-prefix forward with no cache, and
once in pieces through a KVCache. The logits for each position must agree to a tolerance; the error is
measured, never assumed. A model whose attention is not causal fails here, as it must: its earlier
positions change when tokens are appended, so their cached keys and values go stale.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from kvlab import validate
from kvlab.verify.schedules import engine_schedules
from kvlab.verify.structured import structured_schedules
from kvlab.sampling.grammar import CompiledGrammar
from kvlab.model.llama import LlamaModel


# Rounding error of a cached-vs-full comparison, in units of eps x max|logit|, measured per layer: 1.5-2 on
# the tiny model (2 layers) and the shipped model (4 layers), 1.1-1.5 on a 30-layer 2048-wide model (1.2e-4
# at |logit| ~30 in float32, 3e-13 in float64). 8 leaves a margin of 4x or more over all of them.
ERROR_UNITS_PER_LAYER = 8


@dataclass(frozen=True)
class Tolerance:
    """Allowed max abs error = rtol x max|logit| + atol, where max|logit| is the reference's magnitude.

    Why not one fixed number: float32 rounding grows with the logits' size and the model's depth, so a fixed
    1e-4 cries wolf on a 30-layer model, while float64's is ~1e9 times smaller and would hide real bugs
    under a float32-sized bound. `rule` says how the numbers were derived, for the verdict.
    """

    rtol: float
    atol: float
    rule: str

    def at(self, max_abs_logit: float) -> float:
        return self.rtol * max_abs_logit + self.atol


@dataclass(frozen=True)
class CheckResult:
    name: str
    description: str
    max_abs_error: float
    tolerance: float  # for this check: the rule applied to this check's reference logits
    max_abs_logit: float = 0.0

    @property
    def passed(self) -> bool:
        return bool(self.max_abs_error <= self.tolerance)


def default_tolerance(model: LlamaModel) -> Tolerance:
    """rtol = atol = ERROR_UNITS_PER_LAYER x num_layers x eps(compute dtype)."""
    eps = float(np.finfo(model.dtype).eps)
    layers = model.config.num_hidden_layers
    k = ERROR_UNITS_PER_LAYER * layers * eps
    return Tolerance(rtol=k, atol=k, rule=f"(max|logit| + 1) x {ERROR_UNITS_PER_LAYER} x {layers} layers x "
                                          f"eps {eps:.2e} ({model.dtype.name})")


def fixed_tolerance(value: float) -> Tolerance:
    value = validate.finite_float(value, "tolerance", low=0.0)
    return Tolerance(rtol=0.0, atol=value, rule=f"fixed at {value:.1e} (--tolerance)")


def _full(model: LlamaModel, ids: np.ndarray) -> np.ndarray:
    return model.forward(ids).logits


def _chunked(model: LlamaModel, ids: np.ndarray, sizes: list[int]) -> np.ndarray:
    """Feed ids through one cache in chunks of `sizes`; return the logits of every position."""
    cache, start, rows = None, 0, []
    for size in sizes:
        out = model.forward(ids[:, start:start + size], cache=cache, use_cache=True)
        cache, start = out.cache, start + size
        rows.append(out.logits)
    return np.concatenate(rows, axis=1)


def _error(got: np.ndarray, want: np.ndarray) -> tuple[float, float]:
    """(max abs error, max |logit| of the reference `want`)."""
    return float(np.max(np.abs(got - want))), float(np.max(np.abs(want)))


def _worst(*pairs: tuple[float, float]) -> tuple[float, float]:
    return max(p[0] for p in pairs), max(p[1] for p in pairs)


def _random_sizes(rng: np.random.Generator, total: int) -> list[int]:
    sizes = []
    while total > 0:
        size = int(rng.integers(1, min(total, 7) + 1))
        sizes.append(size)
        total -= size
    return sizes


def schedules(model: LlamaModel, rng: np.random.Generator,
              length: int) -> list[tuple[str, str, Callable[[], tuple[float, float]]]]:
    """(name, description, run) for each schedule; run() returns (max abs error, max |reference logit|)."""
    vocab = model.config.vocab_size
    ids = rng.integers(0, vocab, size=(1, length))
    prefill = max(1, length // 3)

    def decode() -> tuple[float, float]:
        sizes = [prefill] + [1] * (length - prefill)
        return _error(_chunked(model, ids, sizes), _full(model, ids))

    def chunks() -> tuple[float, float]:
        return _error(_chunked(model, ids, _random_sizes(rng, length)), _full(model, ids))

    def batch() -> tuple[float, float]:
        batch_ids = rng.integers(0, vocab, size=(3, length))
        return _error(_chunked(model, batch_ids, _random_sizes(rng, length)), _full(model, batch_ids))

    def fork() -> tuple[float, float]:
        tail_a = rng.integers(0, vocab, size=(1, length - prefill))
        tail_b = rng.integers(0, vocab, size=(1, length - prefill))
        base = model.forward(ids[:, :prefill], use_cache=True).cache
        branch = base.fork()
        got_a = model.forward(tail_a, cache=base).logits
        got_b = model.forward(tail_b, cache=branch).logits
        want_a = _full(model, np.concatenate([ids[:, :prefill], tail_a], axis=1))[:, prefill:]
        want_b = _full(model, np.concatenate([ids[:, :prefill], tail_b], axis=1))[:, prefill:]
        return _worst(_error(got_a, want_a), _error(got_b, want_b))

    def crop() -> tuple[float, float]:
        keep = max(1, length // 2)
        cache = model.forward(ids, use_cache=True).cache
        cache.crop(keep)
        regrow = rng.integers(0, vocab, size=(1, length - keep))
        got = model.forward(regrow, cache=cache).logits
        want = _full(model, np.concatenate([ids[:, :keep], regrow], axis=1))[:, keep:]
        return _error(got, want)

    return [
        ("decode", f"prefill {prefill}, then {length - prefill} single tokens", decode),
        ("chunks", "random multi-token chunks (1-7)", chunks),
        ("batch", "batch of 3 sequences, random chunks", batch),
        ("fork", f"fork after {prefill}, two different continuations", fork),
        ("crop", f"prefill {length}, crop to {max(1, length // 2)}, regrow with new tokens", crop),
        *engine_schedules(model, rng, length),
    ]


def verify_model(model: LlamaModel, tolerance: float | Tolerance | None = None, seed: int = 0,
                 length: int = 24, grammar: CompiledGrammar | None = None,
                 tokenizer: object = None) -> list[CheckResult]:
    """Run every schedule on `model`; each result carries its measured max abs error and its tolerance.

    `tolerance`: None = `default_tolerance(model)` (scaled by dtype, depth and each check's logits), a
    number = that fixed bound. `grammar` (compiled for `tokenizer`'s vocabulary) adds the schedules of
    kvlab/verify/structured.py: constrained greedy tokens and masked logits against a plain recompute.
    """
    if tolerance is None:
        tolerance = default_tolerance(model)
    elif not isinstance(tolerance, Tolerance):
        tolerance = fixed_tolerance(tolerance)
    length = min(validate.int_in_range(length, "length", 2), model.config.max_position_embeddings)
    rng = np.random.default_rng(validate.seed(seed, allow_random=False))
    results = []
    extra = [] if grammar is None else structured_schedules(model, grammar, rng, length, tokenizer)
    for name, description, run in [*schedules(model, rng, length), *extra]:
        error, scale = run()
        results.append(CheckResult(name, description, error, tolerance.at(scale), scale))
    return results
