"""KVCache: the per-sequence-batch cache a model reads and extends, over any KVStore backend.

It keeps the bookkeeping that is the same for every storage layout: the committed length
(num_cached_tokens, a plain int), the absolute position of every cached row, and what produced the rows
(CacheSpec). Storage itself sits behind the KVStore protocol (contiguous today, paged later).

Sliding layers (`windows`, one per layer, None: full attention; a hybrid model's
`ModelConfig.layer_window`): on a float contiguous store, a layer of window W gives back its rows before
the W - 1 that the next query still sees once it holds max(W, MIN_CAPACITY) more, so it holds at most
about 2W + a chunk rows however long the sequence grows, and `layer_start(i)` says which row is its first.
Such a cache cannot go back into what it gave back: `crop` there is refused (crop(0) always works).

This is the reference cache (the seeds' `forward(ids, cache=...)`, `kvlab.generate`, the verifier's plain
twin): it keeps every row it is given. Cache policies that drop rows run in the engine's block pool
(kvlab/engine/kv_bounds.py).
"""

from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np

from kvlab import validate
from kvlab.cache.base import CacheSpec, KVStore
from kvlab.cache.contiguous import MIN_CAPACITY, ContiguousStore
from kvlab.cache.memory import MemoryReport
from kvlab.cache.dtypes import KV_CACHE_DTYPES, resolve_kv_dtype  # noqa: F401 (KV_CACHE_DTYPES: re-exported)
from kvlab.cache.quant import QuantFormat
from kvlab.cache.quantized import QuantizedStore
from kvlab.errors import CacheMismatchError, InputError

class KVCache:
    """Cached keys (after RoPE) and values (unrotated) of every layer, with their absolute positions.

    `len(cache)` is the number of layers; `cache[i]` gives (keys, values) views [B, H_kv, T, d] of layer
    i's filled part; `get_seq_length()` is T. A forward with this cache appends to it in place; use
    `fork()` to branch one prefix into independent continuations.
    """

    def __init__(self, spec: CacheSpec, batch_size: int = 1, kv_dtype: object = None,
                 capacity: int = MIN_CAPACITY, store: KVStore | None = None,
                 windows: Sequence[int | None] | None = None) -> None:
        self.spec = spec
        self.batch_size = validate.int_in_range(batch_size, "batch_size", 1)
        self.dtype = resolve_kv_dtype(kv_dtype, spec.compute_dtype)
        capacity = validate.int_in_range(capacity, "capacity", 0)
        try:
            if store is None and isinstance(self.dtype, QuantFormat):
                store = QuantizedStore(spec.num_layers, self.batch_size, spec.num_kv_heads, spec.head_dim,
                                       self.dtype, spec.compute_dtype, capacity)
            self.store: KVStore = store if store is not None else ContiguousStore(
                spec.num_layers, self.batch_size, spec.num_kv_heads, spec.head_dim, self.dtype, capacity)
        except (MemoryError, ValueError) as exc:  # NumPy: out of memory, or "array is too big"
            raise InputError(f"cannot allocate a cache for batch {self.batch_size} x {capacity} positions "
                             f"({type(exc).__name__}: {exc})") from None
        self._positions = np.zeros(max(self.store.capacity_tokens, 1), dtype=np.int64)
        self._length = 0
        if windows is not None and len(windows) != spec.num_layers:
            raise InputError(f"windows must give one window (or None) per layer: {spec.num_layers}, got "
                             f"{len(windows)}")
        # per layer: its window where it trims (a float contiguous store), else None; and its first row
        self._windows = [w if isinstance(self.store, ContiguousStore) else None
                         for w in (windows or [None] * spec.num_layers)]
        self._trims = any(w is not None for w in self._windows)  # asked per layer per step: kept, not recounted
        self._first = [0] * spec.num_layers

    @property
    def quantized(self) -> bool:
        """True when rows are stored as int8/int4/fp8 codes (reads return dequantized copies)."""
        return isinstance(self.dtype, QuantFormat)

    # --- the read-only surface -------------------------------------------------------------------------
    def __len__(self) -> int:
        return self.spec.num_layers

    def __getitem__(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        if not -len(self) <= layer < len(self):
            raise IndexError(f"layer {layer} out of range for a {len(self)}-layer cache")
        layer %= len(self)
        return self.store.read(layer, self._length - self._first[layer])

    def __iter__(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        return (self[i] for i in range(len(self)))

    def get_seq_length(self) -> int:
        """num_cached_tokens: how many positions every layer holds."""
        return self._length

    @property
    def num_cached_tokens(self) -> int:
        return self._length

    def layer_start(self, layer: int) -> int:
        """The position of `layer`'s first held row: 0, or where a sliding layer's kept rows begin."""
        return self._first[layer]

    @property
    def trims(self) -> bool:
        """True when some layer gives back the rows before its window."""
        return self._trims

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
        """Payload (codes or rows), scale bytes of quantized caches, and the position ids, as metadata."""
        if isinstance(self.store, QuantizedStore):
            payload, scales = self.store.nbytes(self._length)
        else:
            rows = sum(self._length - first for first in self._first)  # sliding layers: the rows they keep
            payload = 2 * self.batch_size * self.spec.num_kv_heads * rows * self.spec.head_dim * self.dtype.itemsize
            scales = 0
        return MemoryReport(
            num_layers=len(self), batch_size=self.batch_size, num_tokens=self._length,
            capacity_tokens=self.store.capacity_tokens, dtype=self.dtype.name,
            payload_bytes=payload, capacity_bytes=self.store.capacity_bytes,
            metadata_bytes=self._positions.nbytes + scales, scale_bytes=scales)

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
        first = self._first[layer]
        all_keys, all_values = self.store.read(layer, end - first)
        if all_keys.dtype != self.spec.compute_dtype:
            all_keys = all_keys.astype(self.spec.compute_dtype)
            all_values = all_values.astype(self.spec.compute_dtype)
        return all_keys, all_values, self._positions[first:end]

    @property
    def in_place(self) -> bool:
        """True when kernels may read rows where they lie (`append`): a float store, or a quantized one
        whose codes the decode kernels read as stored (`store.in_place`: keys grouped per token, none
        waiting for a rotation). Other stores return decoded or gathered copies, read through `update`."""
        return hasattr(self.store, "storage") and getattr(self.store, "in_place", True)

    def append(self, layer: int, keys: np.ndarray, values: np.ndarray,
               positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """`update` for kernels that read the cache where it lies: write the new rows and return the layer's
        storage arrays [B, H_kv, capacity, d] in the cache dtype (rows before num_cached_tokens + new are
        valid, counted from `layer_start(layer)`), with no upcast of a float16/bfloat16 cache; a quantized
        store's StoredCodes."""
        self._write(layer, keys, values, positions)
        return self.store.storage(layer)

    def claim(self, layer: int, positions: np.ndarray,
              dtype: np.dtype) -> tuple[np.ndarray, np.ndarray, int] | None:
        """For a kernel that copies the new rows in itself (kernels/decode_block.py): `append`'s bookkeeping
        for len(positions) new rows, then the layer's storage arrays [B, H_kv, capacity, d] and the row the
        first new one goes to. None, with nothing done, where the store is not float rows of `dtype` (a
        narrower float or a codec rounds what it writes)."""
        if not isinstance(self.store, ContiguousStore) or self.store.dtype != dtype:
            return None
        row = self._claim(layer, len(positions), positions)
        keys, values = self.store.storage(layer)
        return keys, values, row

    def _write(self, layer: int, keys: np.ndarray, values: np.ndarray, positions: np.ndarray) -> int:
        row = self._claim(layer, keys.shape[2], positions)
        self.store.write(layer, row, keys, values)
        return self._length + keys.shape[2]

    def _claim(self, layer: int, num_new: int, positions: np.ndarray) -> int:
        """Room in `layer` for num_new rows after the committed ones (and, at layer 0, their positions);
        returns the layer's row the first goes to."""
        start = self._length
        end = start + num_new
        first = self._first[layer]
        if self.trims:  # each layer grows by its own rows
            self.store.reserve(end - first, layer)
        if layer == 0:
            if not self.trims:
                self.store.reserve(end)
            if self._positions.shape[0] < end:
                grown = np.zeros(max(end, 2 * self._positions.shape[0]), dtype=np.int64)
                grown[:start] = self._positions[:start]
                self._positions = grown
            self._positions[start:end] = positions
        return start - first

    def commit(self, num_new: int) -> None:
        self._length += int(num_new)
        for layer, window in enumerate(self._windows):
            # the next query (at position length) sees keys from length - W + 1: give back the rows before,
            # once there are max(W, MIN_CAPACITY) of them (one move of W - 1 rows per that many tokens)
            slack = max(window or 0, MIN_CAPACITY)
            if window is not None and self._length - window + 1 - self._first[layer] >= slack:
                start = self._length - window + 1
                # rows held at most until the next move (a decode step's growth): a long prefill's arrays shrink
                self.store.drop_front(layer, start - self._first[layer], self._length - self._first[layer],
                                      capacity=window - 1 + slack)
                self._first[layer] = start

    # --- editing -----------------------------------------------------------------------------------------
    def crop(self, max_length: int) -> None:
        """Keep the first `max_length` positions (negative: drop that many from the end), as HF's crop."""
        if not validate.is_int(max_length):
            raise InputError(f"crop length must be an int, got {max_length!r}")
        n = int(max_length)
        if n < 0:
            n = self._length + n
        if not 0 <= n <= self._length:
            raise InputError(f"cannot crop a cache of {self._length} tokens to {max_length}")
        for window, first in zip(self._windows, self._first):
            if window is not None and n > 0 and first > max(n - window + 1, 0):
                raise InputError(f"cannot crop to {n} tokens: a sliding layer (window {window}) gave back the "
                                 f"rows before position {first}, and a query at {n} sees from "
                                 f"{max(n - window + 1, 0)}; crop to 0 and recompute")
        if n == 0:
            self._first = [0] * len(self)
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
        lengths = [self._length - first for first in self._first]
        store = self.store.copy(lengths if self.trims else self._length)
        clone = KVCache(self.spec, self.batch_size, self.dtype, store=store, windows=self._windows)
        if clone._positions.shape[0] < self._length:  # a sliding first layer's store is shorter than the text
            clone._positions = np.zeros(self._length, dtype=np.int64)
        clone._positions[: self._length] = self._positions[: self._length]
        clone._length = self._length
        clone._first = list(self._first)
        return clone

    def __repr__(self) -> str:
        return (f"KVCache(layers={len(self)}, batch={self.batch_size}, tokens={self._length}, "
                f"dtype={self.dtype.name}, fingerprint={self.spec.fingerprint[:12]})")


def new_cache(spec: CacheSpec, batch_size: int = 1, kv_dtype: object = None,
              capacity: int = MIN_CAPACITY, windows: Sequence[int | None] | None = None) -> KVCache:
    """An empty cache for the model that `spec` describes: what `LlamaModel.new_cache` and
    `forward(use_cache=True)` ask for, so that the model itself never names a concrete cache class.
    `windows` (per layer): sliding layers give back the rows before their window (see the module doc)."""
    return KVCache(spec, batch_size, kv_dtype, capacity, windows=windows)
