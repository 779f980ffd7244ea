"""StreamingLLM (Xiao et al. 2023): keep the first S rows, the "attention sinks", plus the last W.

Softmax attention dumps mass on the first few tokens whatever they say; a plain window evicts them and
the model degrades, keeping them restores it. StreamingLLM assigns positions by place in the cache, not
in the text (PolicyCache does so: the sinks at 0..S-1, the window at S..); the engine keeps the window at
its text positions and writes the sinks right before it, which gives the same query-key distances
(kvlab/engine/kv_bounds.py).
"""

from __future__ import annotations

import numpy as np

from kvlab.policies.base import Policy, positive_int, recent


class AttentionSinks(Policy):
    def __init__(self, sinks: int, window: int) -> None:
        self.sinks = positive_int(sinks, "number of sink tokens S", low=0)
        self.window = positive_int(window, "window size W")
        self.budget = self.sinks + self.window
        self.name = f"sinks:{self.sinks}:{self.window}"

    @property
    def max_chunk(self) -> int:
        return self.window

    def keep(self, length: int, num_new: int) -> np.ndarray:
        tail = recent(length, self.window - num_new)
        return np.concatenate([np.arange(min(self.sinks, tail[0] if tail.size else length)), tail])
