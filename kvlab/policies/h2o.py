"""H2O heavy hitters (Zhang et al. 2023): under a fixed budget, keep the tokens that have received the
most attention so far, plus a window of the most recent ones.

Scores are accumulated from the model's attention probabilities: `forward_with_policy` passes `observe`
to the model's forward, whose attention (an ObservedAttention, kvlab/model/attention.py) shows it
(layer, q, k, mask) after each layer; it adds each key's probability mass, summed over batch, layers,
query heads and queries. One score per row, because the cache keeps one set of rows for all layers and
heads (H2O itself chooses per head; that needs a per-head cache layout). Observed attention gathers the
keys into the compute dtype and runs the NumPy reference, which costs speed, and the scores cost one more
q.k product per layer.
Kept rows are packed to positions 0..n-1 like every policy (kvlab/policies/apply.py), which shortens the
distances between surviving heavy hitters: a difference from H2O's reference code, which keeps positions.
"""

from __future__ import annotations

import math

import numpy as np

from kvlab.model.layers import softmax_
from kvlab.policies.base import Policy, positive_int, recent


class HeavyHitters(Policy):
    def __init__(self, heavy: int, recent_window: int) -> None:
        self.heavy = positive_int(heavy, "number of heavy hitters", low=0)
        self.recent = positive_int(recent_window, "recent window")
        self.budget = self.heavy + self.recent
        self.name = f"h2o:{self.heavy}:{self.recent}"
        self.scores = np.zeros(0)

    @property
    def max_chunk(self) -> int:
        return self.recent

    def start(self, cache) -> None:
        self.scores = np.zeros(cache.get_seq_length())

    def observe(self, layer: int, q: np.ndarray, k: np.ndarray, mask: np.ndarray | None) -> None:
        """Add this layer's attention probabilities per key (q [B, H_q, n, d], k [B, H_kv, T, d])."""
        batch, heads, num, dim = q.shape
        kv_heads, total = k.shape[1], k.shape[2]
        q5 = q.reshape(batch, kv_heads, heads // kv_heads * num, dim) * (1.0 / math.sqrt(dim))
        probs = softmax_(q5 @ np.swapaxes(k, -1, -2),
                         None if mask is None else np.tile(mask, (heads // kv_heads, 1)))
        if self.scores.shape[0] < total:
            self.scores = np.concatenate([self.scores, np.zeros(total - self.scores.shape[0])])
        self.scores[:total] += probs.sum(axis=(0, 1, 2))

    def keep(self, length: int, num_new: int) -> np.ndarray:
        tail = recent(length, self.recent - num_new)
        older = self.scores[: tail[0] if tail.size else length]
        heavy = np.sort(np.argsort(-older, kind="stable")[: self.heavy])
        rows = np.concatenate([heavy, tail]).astype(np.int64)
        self.scores = self.scores[rows]
        return rows
