"""The Cache protocol the model talks to, and the KVStore protocol storage backends implement.

The model asks its cache one thing per layer: "here are the new keys and values at these positions; give
me all keys, values and key positions to attend to" (`update`), then `commit`s once every layer has
written. Until the commit the new rows are invisible to `get_seq_length`, so a forward that fails half-way
leaves the cache exactly as it was (DESIGN invariant 8).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np


@dataclass(frozen=True)
class CacheSpec:
    """What produced a cache: cached K/V are valid only for this exact model and dtype (invariant 6)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    compute_dtype: np.dtype
    fingerprint: str


class KVStore(Protocol):
    """Physical K/V storage for all layers of one batch of sequences, laid out [B, H_kv, T, d] per layer."""

    def reserve(self, num_tokens: int) -> None:
        """Ensure room for `num_tokens` positions (amortized growth; existing rows are kept)."""

    def write(self, layer: int, start: int, keys: np.ndarray, values: np.ndarray) -> None:
        """Store keys/values [B, H_kv, n, d] at positions start..start+n-1 of `layer`."""

    def read(self, layer: int, length: int) -> tuple[np.ndarray, np.ndarray]:
        """Views of the first `length` positions of `layer`: ([B, H_kv, length, d], same)."""

    def storage(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """The layer's whole K/V arrays [B, H_kv, capacity, d] in the cache dtype, for in-place kernels.
        Optional: a store without it (quantized, paged) is read through `read`."""

    def copy(self, length: int) -> "KVStore":
        """An independent store holding the first `length` positions."""

    @property
    def capacity_tokens(self) -> int: ...

    @property
    def capacity_bytes(self) -> int: ...


class Cache(Protocol):
    """What `LlamaModel.forward` needs from a cache."""

    spec: CacheSpec

    def get_seq_length(self) -> int: ...

    def check_compatible(self, spec: CacheSpec, batch_size: int) -> None:
        """Raise CacheMismatchError if this cache was not produced by `spec` at this batch size."""

    def update(self, layer: int, keys: np.ndarray, values: np.ndarray,
               positions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Write the new rows of `layer`; return (all keys, all values, all key positions)."""

    def commit(self, num_new: int) -> None:
        """Make the rows written by the last round of `update`s part of the cache."""
