"""Preallocated contiguous K/V storage with amortized growth.

One array per layer for keys and one for values, [B, H_kv, capacity, d]. Appending writes into a view;
when capacity runs out it doubles, so the whole cache is copied only O(log T) times over a sequence.
"""

from __future__ import annotations

import numpy as np

MIN_CAPACITY = 16


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

    def reserve(self, num_tokens: int) -> None:
        capacity = self.capacity_tokens
        if num_tokens <= capacity:
            return
        new_capacity = max(num_tokens, 2 * capacity, MIN_CAPACITY)
        for arrays in (self._keys, self._values):
            for i, old in enumerate(arrays):
                grown = self._alloc(new_capacity)
                grown[:, :, :capacity] = old
                arrays[i] = grown

    def write(self, layer: int, start: int, keys: np.ndarray, values: np.ndarray) -> None:
        end = start + keys.shape[2]
        self._keys[layer][:, :, start:end] = keys
        self._values[layer][:, :, start:end] = values

    def read(self, layer: int, length: int) -> tuple[np.ndarray, np.ndarray]:
        return self._keys[layer][:, :, :length], self._values[layer][:, :, :length]

    def storage(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """The layer's whole preallocated arrays (C-contiguous, [B, H_kv, capacity, d]), for kernels."""
        return self._keys[layer], self._values[layer]

    def copy(self, length: int) -> "ContiguousStore":
        batch, heads, dim = self.shape
        clone = ContiguousStore(len(self._keys), batch, heads, dim, self.dtype, max(length, MIN_CAPACITY))
        for layer in range(len(self._keys)):
            clone.write(layer, 0, *self.read(layer, length))
        return clone
