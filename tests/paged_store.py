"""PagedStore: a KVStore over a BlockPool for one sequence, so the plain `KVCache` (and `model.forward`) runs on
blocks. Test-only (it proves the cache protocol holds over paged storage, copy-on-write forks included); the
engine keeps its block tables itself (kvlab/engine/scheduler.py)."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from kvlab.cache.paged import BlockPool, gather_blocks, slot_mapping, write_slots
from kvlab.errors import InputError


class PagedStore:
    """A KVStore over a BlockPool for one sequence, so `KVCache` (and `LlamaModel.forward`) run on blocks.

    Blocks are taken from the pool as positions are reserved; `copy` shares the full blocks (ref counts)
    and copies only the partially filled last one, so a fork costs at most one block. Call `release`
    when done with it, or the pool keeps the blocks.
    """

    def __init__(self, pool: BlockPool, block_table: Sequence[int] = ()) -> None:
        self.pool = pool
        self.block_table = list(block_table)
        self.dtype = pool.read_dtype

    @property
    def capacity_tokens(self) -> int:
        return len(self.block_table) * self.pool.block_size

    @property
    def capacity_bytes(self) -> int:
        return len(self.block_table) * self.pool.bytes_per_block

    def reserve(self, num_tokens: int) -> None:
        more = self.pool.blocks_for(num_tokens) - len(self.block_table)
        if more > 0:
            self.block_table += self.pool.allocate(more)

    def write(self, layer: int, start: int, keys: np.ndarray, values: np.ndarray) -> None:
        if keys.shape[0] != 1:
            raise InputError(f"a PagedStore holds one sequence, got a batch of {keys.shape[0]}")
        if layer == 0:
            self._own(start, keys.shape[2])
        slots = slot_mapping(self.block_table, start, keys.shape[2], self.pool.block_size)
        write_slots(self.pool.key_cache[layer], self.pool.value_cache[layer], slots,
                    keys[0].transpose(1, 0, 2), values[0].transpose(1, 0, 2))

    def _own(self, start: int, count: int) -> None:
        """Copy-on-write: blocks about to be written that a fork also holds are copied first."""
        size = self.pool.block_size
        for index in range(start // size, self.pool.blocks_for(start + count)):
            block = self.block_table[index]
            if self.pool.ref_counts[block] > 1:
                [copy] = self.pool.allocate(1)
                self.pool.copy_block(block, copy, size)
                self.pool.release([block])
                self.block_table[index] = copy

    def read(self, layer: int, length: int) -> tuple[np.ndarray, np.ndarray]:
        table = np.asarray([self.block_table[:self.pool.blocks_for(length)]], dtype=np.int64)
        if table.shape[1] == 0:
            shape = (1, self.pool.key_cache[layer].shape[1], 0, self.pool.key_cache[layer].shape[3])
            return np.zeros(shape, self.dtype), np.zeros(shape, self.dtype)
        return (gather_blocks(self.pool.key_cache[layer], table, length),
                gather_blocks(self.pool.value_cache[layer], table, length))

    def copy(self, length: int) -> "PagedStore":
        full, partial = divmod(length, self.pool.block_size)
        shared = self.block_table[:full]
        if partial and self.pool.num_free_blocks < 1:
            raise InputError("no free block for the copy of the partially filled last block")
        self.pool.acquire(shared)
        table = list(shared)
        if partial:
            [block] = self.pool.allocate(1)
            self.pool.copy_block(self.block_table[full], block, partial)
            table.append(block)
        return PagedStore(self.pool, table)

    def release(self) -> None:
        """Give every block back to the pool."""
        self.pool.release(self.block_table)
        self.block_table = []
