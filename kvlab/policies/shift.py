"""llama.cpp's context shift, and the re-rotation of kept keys every position-moving policy relies on.

When the cache is full, keep the first `n_keep` rows, drop the oldest half of the rest, and go on: the
kept tail moves down by the number dropped, so generation never runs out of positions (llama.cpp's
`n_discard = (n_past - n_keep) / 2`, then `llama_kv_cache_seq_add(..., -n_discard)`).

Keys are cached after RoPE (ARCHITECTURE.md invariant 1), so a row that moves from position p to q must have
its key rotated. RoPE rotates each pair of channels by an angle of the position (q * theta_i; LongRoPE
changes theta_i at its pretraining length), and rotations compose: turning the stored key by
angles(q) - angles(p) (`rotate_keys`, with the model's RopeTables.angles) gives the key the model would have
computed at q, exact up to rounding (tests/test_policies.py: 1e-5 in float32, LongRoPE too, and after ~130
evictions in the engine: llama.cpp #5652 / #4097 broke exactly this). Values carry no position and stay as
they are. The angles are computed in float64 whatever the cache dtype.
"""

from __future__ import annotations

import numpy as np

from kvlab.errors import InputError
from kvlab.model.layers import rotate
from kvlab.policies.base import Policy, positive_int


def rotate_keys(keys: np.ndarray, angles: np.ndarray) -> np.ndarray:
    """Keys [B, H_kv, n, d] rotated by `angles` [n, d/2] (float64: RopeTables.angles(new) - angles(old));
    same dtype as given."""
    angles = np.concatenate([angles, angles], axis=-1)
    return rotate(keys.astype(np.float64), np.cos(angles), np.sin(angles)).astype(keys.dtype, copy=False)


class ContextShift(Policy):
    def __init__(self, n_keep: int, budget: int) -> None:
        self.n_keep = positive_int(n_keep, "n_keep", low=0)
        self.budget = positive_int(budget, "context shift budget")
        if self.n_keep >= self.budget - 1:
            raise InputError(f"context shift keeps {self.n_keep} tokens of a {self.budget}-token cache: "
                             "nothing would be left to discard (need n_keep < budget - 1)")
        self.name = f"shift:{self.n_keep}:{self.budget}"

    @property
    def max_chunk(self) -> int:
        return self.budget - self.n_keep

    def keep(self, length: int, num_new: int) -> np.ndarray:
        n_keep = min(self.n_keep, length)
        n_discard = max((length - n_keep) // 2, length + num_new - self.budget)
        return np.concatenate([np.arange(n_keep), np.arange(n_keep + n_discard, length)])
