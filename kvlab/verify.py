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

from kvlab.engine.schedules import engine_schedules
from kvlab.model.llama import LlamaModel


@dataclass(frozen=True)
class CheckResult:
    name: str
    description: str
    max_abs_error: float
    tolerance: float

    @property
    def passed(self) -> bool:
        return bool(self.max_abs_error <= self.tolerance)


def default_tolerance(model: LlamaModel) -> float:
    """1e-10 in float64; float32 accumulates rounding from different matmul shapes, so 1e-4 there."""
    return 1e-10 if model.dtype == np.float64 else 1e-4


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


def _error(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)))


def _random_sizes(rng: np.random.Generator, total: int) -> list[int]:
    sizes = []
    while total > 0:
        size = int(rng.integers(1, min(total, 7) + 1))
        sizes.append(size)
        total -= size
    return sizes


def schedules(model: LlamaModel, rng: np.random.Generator,
              length: int) -> list[tuple[str, str, Callable[[], float]]]:
    """(name, description, run) for each schedule; run() returns the max abs error."""
    vocab = model.config.vocab_size
    ids = rng.integers(0, vocab, size=(1, length))
    prefill = max(1, length // 3)

    def decode() -> float:
        sizes = [prefill] + [1] * (length - prefill)
        return _error(_chunked(model, ids, sizes), _full(model, ids))

    def chunks() -> float:
        return _error(_chunked(model, ids, _random_sizes(rng, length)), _full(model, ids))

    def batch() -> float:
        batch_ids = rng.integers(0, vocab, size=(3, length))
        return _error(_chunked(model, batch_ids, _random_sizes(rng, length)), _full(model, batch_ids))

    def fork() -> float:
        tail_a = rng.integers(0, vocab, size=(1, length - prefill))
        tail_b = rng.integers(0, vocab, size=(1, length - prefill))
        base = model.forward(ids[:, :prefill], use_cache=True).cache
        branch = base.fork()
        got_a = model.forward(tail_a, cache=base).logits
        got_b = model.forward(tail_b, cache=branch).logits
        want_a = _full(model, np.concatenate([ids[:, :prefill], tail_a], axis=1))[:, prefill:]
        want_b = _full(model, np.concatenate([ids[:, :prefill], tail_b], axis=1))[:, prefill:]
        return max(_error(got_a, want_a), _error(got_b, want_b))

    def crop() -> float:
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


def verify_model(model: LlamaModel, tolerance: float | None = None, seed: int = 0,
                 length: int = 24) -> list[CheckResult]:
    """Run every schedule on `model`; each result carries its measured max abs error."""
    tolerance = default_tolerance(model) if tolerance is None else tolerance
    length = min(length, model.config.max_position_embeddings)
    rng = np.random.default_rng(seed)
    return [CheckResult(name, description, run(), tolerance)
            for name, description, run in schedules(model, rng, length)]
