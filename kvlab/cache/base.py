"""The two storage protocols the model talks to (Cache, PagedKV), and the KVStore protocol of backends.

The model's attention (kvlab/model/attention.py) asks a contiguous Cache one thing per layer: "here are
the new keys and values at these positions; give me all keys, values and key positions to attend to"
(`update`; `append` for kernels that read the rows where they lie), then the model `commit`s once every
layer has written. Until the commit the new rows are invisible to `get_seq_length`, so a forward that
fails half-way leaves the cache exactly as it was (ARCHITECTURE.md invariant 8). A block pool (PagedKV) is read and
written per layer through block tables and a slot mapping. The model knows these protocols, never the
classes that implement them (KVCache, BlockPool).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence, runtime_checkable

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


@runtime_checkable
class Cache(Protocol):
    """What `LlamaModel.forward` and its ContiguousAttention need from a cache (KVCache implements it)."""

    spec: CacheSpec

    def get_seq_length(self) -> int: ...

    def layer_start(self, layer: int) -> int:
        """The position of the layer's first held row (0; later for a sliding layer that gave rows back)."""

    @property
    def positions(self) -> np.ndarray:
        """Absolute position of every committed row, [T]: the mask is built from them (invariant 2)."""

    @property
    def in_place(self) -> bool:
        """True when kernels may read the rows where they lie (`append`); False: read through `update`."""

    @property
    def quantized(self) -> bool:
        """True when rows are codes (int8/int4/fp8): `append` then returns StoredCodes, which only the
        decode kernels read; a prefill attends to `update`'s dequantized copies."""

    def check_compatible(self, spec: CacheSpec, batch_size: int) -> None:
        """Raise CacheMismatchError if this cache was not produced by `spec` at this batch size."""

    def update(self, layer: int, keys: np.ndarray, values: np.ndarray,
               positions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Write the new rows of `layer`; return (all keys, all values, all key positions), K/V in the
        compute dtype."""

    def append(self, layer: int, keys: np.ndarray, values: np.ndarray,
               positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Write the new rows of `layer`; return its whole storage arrays [B, H_kv, capacity, d] in the
        cache dtype (only when `in_place`)."""

    def claim(self, layer: int, positions: np.ndarray,
              dtype: np.dtype) -> tuple[np.ndarray, np.ndarray, int] | None:
        """`append` for a kernel that copies the new rows in itself: the layer's storage arrays and the row
        the first new one goes to; None (nothing done) unless the rows are float rows of `dtype`."""

    def commit(self, num_new: int) -> None:
        """Make the rows written by the last round of `update`s part of the cache."""


class PagedKV(Protocol):
    """What PagedAttention needs from a block pool (BlockPool implements it): per layer, the key and value
    blocks [num_blocks, H_kv, block_size, d], float arrays (read in place by the kernels) or quantized
    blocks (written and gathered by `kvlab.cache.paged.write_slots` / `gather_blocks`)."""

    key_cache: Sequence[object]
    value_cache: Sequence[object]
