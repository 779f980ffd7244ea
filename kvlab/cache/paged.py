"""BlockPool: K/V in fixed-size blocks shared by every request, with ref counts and a free list.

Per layer, keys and values live in one array each, [num_blocks, H_kv, block_size, d], allocated once. A
request owns a block table (a list of block ids); a token at position p of a request lives in block
`table[p // block_size]` at offset `p % block_size`, and its global slot is `block * block_size + offset`
(the slot mapping a batched forward writes through).

Every block is in exactly one of three states (ARCHITECTURE.md invariant 7, checked by `check_invariants`):
  - free: holds nothing anyone may read; on the free list;
  - evictable: ref_count 0 but held by an Evictor (the prefix cache, kvlab/prefix/prefix_cache.py), so a
    later request may reuse it; the evictor gives it back, least recently used first, when the pool runs dry;
  - in use: ref_count > 0 (one per block table holding it).
The pool only allocates and counts references: keys, the registry and the LRU are the prefix cache's. It
asks its evictor three things (`hold`, `revive`, `evict_lru`) and knows nothing about how keys are made.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Iterable, Protocol, Sequence

import numpy as np

from kvlab.cache.quant import QuantFormat
from kvlab.cache.quantized import QuantizedBlocks
from kvlab.errors import InputError
from kvlab.validate import positive_int


def slot_mapping(block_table: Sequence[int], start: int, count: int, block_size: int) -> np.ndarray:
    """Global slots [count] of positions start..start+count-1 of a sequence: block * block_size + offset.

    The one place a position becomes a slot: the engine's model runner, session files and verify's paged
    schedule all call it, so they cannot disagree about where a row lives.
    """
    positions = np.arange(start, start + count)
    return np.asarray(block_table, dtype=np.int64)[positions // block_size] * block_size + positions % block_size


def write_slots(key_cache: np.ndarray, value_cache: np.ndarray, slot_mapping: np.ndarray,
                keys: np.ndarray, values: np.ndarray) -> None:
    """Store keys/values [N, H_kv, d] at global slots [N] (slot = block * block_size + row) of one layer."""
    blocks, rows = np.divmod(slot_mapping, key_cache.shape[2])
    write_rows(key_cache, value_cache, blocks, rows, keys, values)


def write_rows(key_cache: np.ndarray, value_cache: np.ndarray, blocks: np.ndarray, rows: np.ndarray,
               keys: np.ndarray, values: np.ndarray) -> None:
    """`write_slots` with the slots already split into (block, row): a forward splits them once for all
    its layers."""
    if isinstance(key_cache, QuantizedBlocks):  # int8/int4/fp8 pool: quantize rows as they are written
        key_cache.write(blocks, rows, keys)
        value_cache.write(blocks, rows, values)
        return
    if len(blocks) == 1:  # a lone decode: basic indexing, a third of a fancy assignment's cost
        block, row = int(blocks[0]), int(rows[0])
        key_cache[block, :, row] = keys[0]
        value_cache[block, :, row] = values[0]
        return
    key_cache[blocks, :, rows] = keys
    value_cache[blocks, :, rows] = values


def gather_blocks(cache: np.ndarray, block_tables: np.ndarray, length: int) -> np.ndarray:
    """The first `length` positions of each row's blocks as one contiguous [B, H_kv, length, d] array."""
    if isinstance(cache, QuantizedBlocks):  # dequantized to the pool's read dtype
        return cache.gather(block_tables, length)
    gathered = cache[block_tables]  # [B, M, H_kv, block_size, d]
    batch, num_blocks, heads, block_size, dim = gathered.shape
    return gathered.transpose(0, 2, 1, 3, 4).reshape(batch, heads, num_blocks * block_size, dim)[:, :, :length]


class Evictor(Protocol):
    """What keeps unreferenced blocks findable instead of free (the prefix cache), as the pool sees it."""

    @property
    def num_evictable(self) -> int: ...

    def evictable_blocks(self) -> set[int]: ...

    def hold(self, block: int) -> bool:
        """The last reference to `block` was dropped: True if it stays findable (evictable), else it is freed."""

    def revive(self, block: int) -> bool:
        """An unreferenced block is acquired again (a prefix hit): True if it was evictable (it leaves the LRU)."""

    def evict_lru(self) -> int:
        """Forget the least recently used evictable block and return it (the pool reuses it)."""

    def check_invariants(self, free: set[int]) -> None:
        """Assert the evictor's own bookkeeping agrees with the pool's free list."""


class BlockPool:
    """Fixed-size K/V blocks for all layers, a free list and ref counts; unreferenced cached blocks are held
    by an optional Evictor (the prefix cache attaches itself) and count as free, as vLLM counts them."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: np.dtype | QuantFormat,
                 block_size: int, num_blocks: int, compute_dtype: np.dtype = np.float32) -> None:
        for name, value in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads),
                            ("head_dim", head_dim), ("block_size", block_size), ("num_blocks", num_blocks)):
            positive_int(value, name)
        self.block_size = int(block_size)
        self.num_blocks = int(num_blocks)
        shape = (self.num_blocks, int(num_kv_heads), self.block_size, int(head_dim))
        if isinstance(dtype, QuantFormat):  # codes + scales per block (cache/quantized.py), read in compute_dtype
            self.dtype, self.read_dtype = dtype, np.dtype(compute_dtype)
            self.key_cache = [QuantizedBlocks(dtype, *shape, self.read_dtype) for _ in range(num_layers)]
            self.value_cache = [QuantizedBlocks(dtype, *shape, self.read_dtype) for _ in range(num_layers)]
        else:
            self.dtype = self.read_dtype = np.dtype(dtype)
            self.key_cache = [np.zeros(shape, dtype=self.dtype) for _ in range(num_layers)]
            self.value_cache = [np.zeros(shape, dtype=self.dtype) for _ in range(num_layers)]
        self.ref_counts = [0] * self.num_blocks
        self._free: deque[int] = deque(range(self.num_blocks))
        self.evictor: Evictor | None = None

    def attach(self, evictor: Evictor) -> None:
        """Let `evictor` hold unreferenced blocks (once, before any block is released)."""
        if self.evictor is not None:
            raise InputError("this pool already has an evictor (one prefix cache per pool)")
        self.evictor = evictor

    # --- accounting ----------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks no request references: plain free plus cached-evictable (as vLLM counts them)."""
        return len(self._free) + self.num_evictable_blocks

    @property
    def num_evictable_blocks(self) -> int:
        return self.evictor.num_evictable if self.evictor is not None else 0

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def bytes_per_block(self) -> int:
        return 2 * len(self.key_cache) * (self.key_cache[0].nbytes // self.num_blocks) if self.key_cache else 0

    @property
    def capacity_bytes(self) -> int:
        return sum(a.nbytes for a in self.key_cache) + sum(a.nbytes for a in self.value_cache)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` positions."""
        return math.ceil(num_tokens / self.block_size)

    def check_invariants(self) -> None:
        """free + evictable + in use == total, and each block in exactly one state (catches double frees)."""
        free = set(self._free)
        evictable = self.evictor.evictable_blocks() if self.evictor is not None else set()
        used = {b for b, r in enumerate(self.ref_counts) if r > 0}
        assert len(free) == len(self._free), "a block is on the free list twice"
        assert all(r >= 0 for r in self.ref_counts), "negative ref count"
        assert not (free & evictable) and not (free & used) and not (evictable & used), "block in two states"
        assert len(free) + len(evictable) + len(used) == self.num_blocks, "blocks leaked"
        if self.evictor is not None:
            self.evictor.check_invariants(free)

    # --- allocation ----------------------------------------------------------------------------------------
    def allocate(self, count: int) -> list[int]:
        """`count` blocks with ref_count 1: free ones first, then the least recently used evictable ones."""
        if count > self.num_free_blocks:
            raise InputError(f"asked for {count} blocks but only {self.num_free_blocks} are free")
        blocks = []
        for _ in range(count):
            block = self._free.popleft() if self._free else self.evictor.evict_lru()
            self.ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def acquire(self, blocks: Iterable[int]) -> None:
        """One more reference to each of `blocks` (a prefix hit or a fork); evictable blocks leave the LRU."""
        for block in blocks:
            if self.ref_counts[block] == 0 and (self.evictor is None or not self.evictor.revive(block)):
                raise InputError(f"block {block} is free: only in-use or cached blocks can be shared")
            self.ref_counts[block] += 1

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each block of a block table.

        Blocks reaching 0 become evictable if the evictor holds them (else free). They are released tail
        first, as vLLM does, so a sequence's last blocks are evicted before its first ones, which more
        requests share.
        """
        for block in reversed(blocks):
            if self.ref_counts[block] <= 0:
                raise InputError(f"block {block} released more often than acquired")
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0 and (self.evictor is None or not self.evictor.hold(block)):
                self._free.append(block)

    def free_evicted(self, block: int) -> None:
        """An evictable block the evictor has forgotten goes back on the free list."""
        if self.ref_counts[block] != 0:
            raise InputError(f"block {block} is in use: only unreferenced blocks can be freed")
        self._free.append(block)

    def make_private(self, table: list[int], index: int, num_tokens: int) -> None:
        """Copy-on-write: `table[index]` becomes a block only this table holds, with the first `num_tokens`
        rows of the one it replaces. The one copy-on-write of the engine (a fork's shared tail, a policy's
        sink rows). The old block is released first: its rows stay intact until a block is allocated, and if
        the pool hands that very block back (it was cached and only ours) it is already ours alone."""
        block = table[index]
        self.release([block])
        [copy] = self.allocate(1)
        if copy != block:
            self.copy_block(block, copy, num_tokens)
        table[index] = copy

    def copy_block(self, src: int, dst: int, num_tokens: int) -> None:
        """Copy the first `num_tokens` rows of block `src` into `dst` in every layer (copy-on-write)."""
        for arrays in (self.key_cache, self.value_cache):
            for layer in arrays:
                if isinstance(layer, QuantizedBlocks):
                    layer.copy_rows(src, dst, num_tokens)
                else:
                    layer[dst, :, :num_tokens] = layer[src, :, :num_tokens]
