"""KVCache: the per-sequence-batch cache a model reads and extends, over any KVStore backend.

It keeps the bookkeeping that is the same for every storage layout: the committed length
(num_cached_tokens, a plain int), the absolute position of every cached row, and what produced the rows
(CacheSpec). Storage itself sits behind the KVStore protocol (contiguous today, paged later).
"""

from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np

from kvlab.cache.base import CacheSpec, KVStore
from kvlab.cache.contiguous import MIN_CAPACITY, ContiguousStore
from kvlab.cache.memory import MemoryReport
from kvlab.errors import CacheMismatchError, InputError

try:  # bfloat16 storage for caches; optional at import time, required to use it
    import ml_dtypes
    _BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover
    _BFLOAT16 = None


def resolve_kv_dtype(kv_dtype: object, compute_dtype: np.dtype) -> np.dtype:
    """Map a name ("float16", "bf16", ...) or dtype to the NumPy dtype cached rows are stored in."""
    if kv_dtype is None:
        return np.dtype(compute_dtype)
    name = str(getattr(kv_dtype, "__name__", kv_dtype)).lower()
    name = {"fp64": "float64", "fp32": "float32", "fp16": "float16", "half": "float16",
            "bf16": "bfloat16"}.get(name, name)
    if name == "bfloat16" and _BFLOAT16 is not None:
        return _BFLOAT16
    if name in ("float64", "float32", "float16"):
        return np.dtype(name)
    raise InputError(f"unsupported KV cache dtype {kv_dtype!r}: choose float64, float32, float16 or bfloat16")


class KVCache:
    """Cached keys (after RoPE) and values (unrotated) of every layer, with their absolute positions.

    `len(cache)` is the number of layers; `cache[i]` gives (keys, values) views [B, H_kv, T, d] of layer
    i's filled part; `get_seq_length()` is T. A forward with this cache appends to it in place; use
    `fork()` to branch one prefix into independent continuations.
    """

    def __init__(self, spec: CacheSpec, batch_size: int = 1, kv_dtype: object = None,
                 capacity: int = MIN_CAPACITY, store: KVStore | None = None) -> None:
        self.spec = spec
        self.batch_size = int(batch_size)
        self.dtype = resolve_kv_dtype(kv_dtype, spec.compute_dtype)
        self.store: KVStore = store if store is not None else ContiguousStore(
            spec.num_layers, self.batch_size, spec.num_kv_heads, spec.head_dim, self.dtype, capacity)
        self._positions = np.zeros(max(self.store.capacity_tokens, 1), dtype=np.int64)
        self._length = 0

    # --- the read-only surface -------------------------------------------------------------------------
    def __len__(self) -> int:
        return self.spec.num_layers

    def __getitem__(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        if not -len(self) <= layer < len(self):
            raise IndexError(f"layer {layer} out of range for a {len(self)}-layer cache")
        return self.store.read(layer % len(self), self._length)

    def __iter__(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        return (self[i] for i in range(len(self)))

    def get_seq_length(self) -> int:
        """num_cached_tokens: how many positions every layer holds."""
        return self._length

    @property
    def num_cached_tokens(self) -> int:
        return self._length

    @property
    def positions(self) -> np.ndarray:
        """Absolute position id of each cached row, [T] (read-only view)."""
        view = self._positions[: self._length]
        view.flags.writeable = False
        return view

    @property
    def fingerprint(self) -> str:
        return self.spec.fingerprint

    def memory_report(self) -> MemoryReport:
        itemsize = self.dtype.itemsize
        payload = 2 * len(self) * self.batch_size * self.spec.num_kv_heads * self._length \
            * self.spec.head_dim * itemsize
        return MemoryReport(
            num_layers=len(self), batch_size=self.batch_size, num_tokens=self._length,
            capacity_tokens=self.store.capacity_tokens, dtype=self.dtype.name,
            payload_bytes=payload, capacity_bytes=self.store.capacity_bytes,
            metadata_bytes=self._positions.nbytes)

    # --- what the model calls ----------------------------------------------------------------------------
    def check_compatible(self, spec: CacheSpec, batch_size: int) -> None:
        if spec.fingerprint != self.spec.fingerprint:
            raise CacheMismatchError(
                "this cache was produced by a different model (fingerprint "
                f"{self.spec.fingerprint[:12]} vs the model's {spec.fingerprint[:12]}): cached keys and "
                "values are only valid for the exact weights, config and dtype that computed them")
        if np.dtype(spec.compute_dtype) != np.dtype(self.spec.compute_dtype):
            raise CacheMismatchError(f"cache computed in {self.spec.compute_dtype}, model runs in "
                                     f"{spec.compute_dtype}")
        if batch_size != self.batch_size:
            raise CacheMismatchError(f"ids have batch size {batch_size} but the cache holds "
                                     f"{self.batch_size} sequences")

    def update(self, layer: int, keys: np.ndarray, values: np.ndarray,
               positions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Write layer `layer`'s new rows after the committed ones; return everything to attend to."""
        end = self._write(layer, keys, values, positions)
        all_keys, all_values = self.store.read(layer, end)
        if all_keys.dtype != self.spec.compute_dtype:
            all_keys = all_keys.astype(self.spec.compute_dtype)
            all_values = all_values.astype(self.spec.compute_dtype)
        return all_keys, all_values, self._positions[:end]

    def append(self, layer: int, keys: np.ndarray, values: np.ndarray,
               positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """`update` for kernels that read the cache where it lies: write the new rows and return the layer's
        storage arrays [B, H_kv, capacity, d] in the cache dtype (rows before num_cached_tokens + new are
        valid), with no upcast of a float16/bfloat16 cache."""
        self._write(layer, keys, values, positions)
        return self.store.storage(layer)

    def _write(self, layer: int, keys: np.ndarray, values: np.ndarray, positions: np.ndarray) -> int:
        start, num_new = self._length, keys.shape[2]
        end = start + num_new
        if layer == 0:
            self.store.reserve(end)
            if self._positions.shape[0] < end:
                grown = np.zeros(max(end, 2 * self._positions.shape[0]), dtype=np.int64)
                grown[:start] = self._positions[:start]
                self._positions = grown
            self._positions[start:end] = positions
        self.store.write(layer, start, keys, values)
        return end

    def commit(self, num_new: int) -> None:
        self._length += int(num_new)

    # --- editing -----------------------------------------------------------------------------------------
    def crop(self, max_length: int) -> None:
        """Keep the first `max_length` positions (negative: drop that many from the end), as HF's crop."""
        if isinstance(max_length, bool) or not isinstance(max_length, (int, np.integer)):
            raise InputError(f"crop length must be an int, got {max_length!r}")
        n = int(max_length)
        if n < 0:
            n = self._length + n
        if not 0 <= n <= self._length:
            raise InputError(f"cannot crop a cache of {self._length} tokens to {max_length}")
        self._length = n

    @classmethod
    def from_arrays(cls, spec: CacheSpec, keys: Sequence[np.ndarray], values: Sequence[np.ndarray],
                    positions: np.ndarray, kv_dtype: object = None) -> "KVCache":
        """Rebuild a cache from per-layer keys/values [B, H_kv, T, d] and their positions [T].

        Why: a cache restored from a file must be the same object the model and the prefix matcher read,
        not a side copy (llama.cpp #26676). Everything is checked before anything is allocated; rows are
        stored in `kv_dtype` (default: the arrays' own dtype).
        """
        if len(keys) != spec.num_layers or len(values) != spec.num_layers:
            raise InputError(f"expected {spec.num_layers} layers of keys and values, got {len(keys)} and "
                             f"{len(values)}")
        shape = tuple(np.shape(keys[0])) if spec.num_layers else ()
        if len(shape) != 4 or shape[1:2] + shape[3:] != (spec.num_kv_heads, spec.head_dim):
            raise InputError(f"keys must be [B, {spec.num_kv_heads}, T, {spec.head_dim}], got {list(shape)}")
        if any(np.shape(a) != shape for a in (*keys, *values)):
            raise InputError("every layer's keys and values must have the same shape")
        positions = np.asarray(positions)
        if positions.shape != (shape[2],) or positions.dtype.kind not in "iu":
            raise InputError(f"positions must be {shape[2]} ints, got {positions.dtype} "
                             f"{list(positions.shape)}")
        cache = cls(spec, shape[0], np.asarray(keys[0]).dtype if kv_dtype is None else kv_dtype,
                    max(shape[2], MIN_CAPACITY))
        for layer in range(spec.num_layers):
            cache.store.write(layer, 0, np.asarray(keys[layer]), np.asarray(values[layer]))
        cache._positions[: shape[2]] = positions
        cache._length = int(shape[2])
        return cache

    def fork(self) -> "KVCache":
        """An independent copy of the filled part: two continuations of one prefix never see each other."""
        clone = KVCache(self.spec, self.batch_size, self.dtype, store=self.store.copy(self._length))
        clone._positions[: self._length] = self._positions[: self._length]
        clone._length = self._length
        return clone

    def __repr__(self) -> str:
        return (f"KVCache(layers={len(self)}, batch={self.batch_size}, tokens={self._length}, "
                f"dtype={self.dtype.name}, fingerprint={self.spec.fingerprint[:12]})")
