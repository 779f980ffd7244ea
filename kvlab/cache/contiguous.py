"""Preallocated contiguous K/V storage with amortized growth.

One array per layer for keys and one for values, [B, H_kv, capacity, d]. Appending writes into a view;
when capacity runs out it doubles, so the whole cache is copied only O(log T) times over a sequence. A
layer may grow alone and drop its first rows (`reserve(n, layer)`, `drop_front`): a KVCache that trims its
sliding-window layers (kvlab/cache/kv_cache.py) keeps each such layer at about its window.
"""

from __future__ import annotations

import numpy as np

MIN_CAPACITY = 16


def grown_capacity(capacity: int, num_tokens: int) -> int:
    """The capacity a contiguous store grows to when `num_tokens` rows do not fit in `capacity`: at least
    double, so that a generation of n tokens reallocates O(log n) times."""
    return max(num_tokens, 2 * capacity, MIN_CAPACITY)


class ContiguousStore:
    """The default KVStore: per-layer preallocated arrays in the cache dtype."""

    def __init__(self, num_layers: int, batch_size: int, num_kv_heads: int, head_dim: int,
                 dtype: np.dtype, capacity: int = MIN_CAPACITY) -> None:
        self.shape = (batch_size, num_kv_heads, head_dim)
        self.dtype = np.dtype(dtype)
        capacity = max(int(capacity), 1)
        self._keys = [self._alloc(capacity) for _ in range(num_layers)]
        self._values = [self._alloc(capacity) for _ in range(num_layers)]

    def _alloc(self, capacity: int) -> np.ndarray:
        batch, heads, dim = self.shape
        return np.zeros((batch, heads, capacity, dim), dtype=self.dtype)

    @property
    def capacity_tokens(self) -> int:
        return self._keys[0].shape[2]

    @property
    def capacity_bytes(self) -> int:
        return sum(a.nbytes for a in self._keys) + sum(a.nbytes for a in self._values)

    def reserve(self, num_tokens: int, layer: int | None = None) -> None:
        """Room for `num_tokens` rows in every layer, or in `layer` alone."""
        for index in range(len(self._keys)) if layer is None else (layer,):
            capacity = self._keys[index].shape[2]
            if num_tokens <= capacity:
                continue
            new_capacity = grown_capacity(capacity, num_tokens)
            for arrays in (self._keys, self._values):
                grown = self._alloc(new_capacity)
                grown[:, :, :capacity] = arrays[index]
                arrays[index] = grown

    def drop_front(self, layer: int, count: int, length: int, capacity: int | None = None) -> None:
        """Move rows [count, length) of `layer` to the front (its first `count` rows are given up); with
        `capacity`, arrays larger than it (a long prefill's) shrink to it."""
        keep = length - count
        for arrays in (self._keys, self._values):
            rows = arrays[layer][:, :, count:length].copy()
            if capacity is not None and arrays[layer].shape[2] > max(capacity, keep, MIN_CAPACITY):
                arrays[layer] = self._alloc(max(capacity, keep, MIN_CAPACITY))
            arrays[layer][:, :, :keep] = rows

    def write(self, layer: int, start: int, keys: np.ndarray, values: np.ndarray) -> None:
        end = start + keys.shape[2]
        self._keys[layer][:, :, start:end] = keys
        self._values[layer][:, :, start:end] = values

    def read(self, layer: int, length: int) -> tuple[np.ndarray, np.ndarray]:
        return self._keys[layer][:, :, :length], self._values[layer][:, :, :length]

    def storage(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """The layer's whole preallocated arrays (C-contiguous, [B, H_kv, capacity, d]), for kernels."""
        return self._keys[layer], self._values[layer]

    def copy(self, length: int | list[int]) -> "ContiguousStore":
        """An independent store of the first `length` rows of every layer (a list: of each layer)."""
        lengths = length if isinstance(length, list) else [length] * len(self._keys)
        batch, heads, dim = self.shape
        clone = ContiguousStore(len(self._keys), batch, heads, dim, self.dtype,
                                max(min(lengths, default=0), MIN_CAPACITY))
        for layer, rows in enumerate(lengths):
            clone.reserve(rows, layer)
            clone.write(layer, 0, *self.read(layer, rows))
        return clone
