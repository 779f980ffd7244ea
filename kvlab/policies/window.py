"""Sliding window: keep the last W rows (Mistral's window: a query sees W keys, itself included)."""

from __future__ import annotations

import numpy as np

from kvlab.policies.base import Policy, positive_int, recent


class SlidingWindow(Policy):
    def __init__(self, window: int) -> None:
        self.window = self.budget = positive_int(window, "window size W")
        self.name = f"window:{self.window}"

    def keep(self, length: int, num_new: int) -> np.ndarray:
        return recent(length, self.window - num_new)
