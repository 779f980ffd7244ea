"""PrefixCache and BlockPool calls the engine tests reach only through a hybrid model or a tier: registering
blocks under keys already computed (`insert_keys`: what it registers, under which parent, what it counts),
the rows a cached block holds (`cached_rows`), and what the pool says when asked to free a block in use."""

from __future__ import annotations

import numpy as np
import pytest

from kvlab.cache.paged import BlockPool
from kvlab.errors import InputError
from kvlab.prefix.block_hash import block_key, root_key
from kvlab.prefix.prefix_cache import PrefixCache

ROOT = root_key("e" * 64, np.float64, np.float64)
TOKENS = [1, 2, 3, 4, 5, 6, 7]  # three whole blocks of 2 and one more token


def make_cache(enabled: bool = True, num_blocks: int = 8) -> tuple[BlockPool, PrefixCache]:
    pool = BlockPool(1, 1, 2, np.float64, block_size=2, num_blocks=num_blocks)
    return pool, PrefixCache(pool, enabled=enabled)


def chain(tokens: list[int], root: bytes = ROOT, size: int = 2) -> list[bytes]:
    keys, parent = [], root
    for start in range(0, len(tokens) - size + 1, size):
        parent = block_key(parent, tokens[start:start + size])
        keys.append(parent)
    return keys


def test_insert_keys_registers_from_start_under_each_blocks_parent_and_counts_them() -> None:
    pool, cache = make_cache()
    table = pool.allocate(3)
    keys = chain(TOKENS)
    assert cache.insert_keys(table, TOKENS, ROOT, keys, 1) == 2  # blocks 1 and 2, not 0
    assert cache.cached_info(table[0]) is None
    assert [cache.cached_info(b).parent for b in table[1:]] == keys[:2]
    assert [cache.cached_info(b).key for b in table[1:]] == keys[1:]
    assert [cache.cached_info(b).token_ids for b in table[1:]] == [(3, 4), (5, 6)]
    assert cache.insert_keys(table, TOKENS, ROOT, keys, 0) == 1  # only block 0 is new
    info = cache.cached_info(table[0])
    assert info.parent == ROOT and info.key == keys[0]
    assert cache.insert_keys(table, TOKENS, ROOT, keys, 0) == 0  # every key is taken
    assert cache.match(TOKENS, ROOT) == (table, keys)
    pool.release(table)
    pool.check_invariants()


def test_insert_keys_marks_the_root_so_chains_are_traced_to_it() -> None:
    pool, cache = make_cache()
    table = pool.allocate(2)
    keys = chain(TOKENS[:4])
    assert cache.insert_keys(table, TOKENS, ROOT, keys, 0) == 2
    first, second = (cache.cached_info(b) for b in table)
    assert cache.chain_parent(first) is None and cache.chain_parent(second) == keys[0]
    assert cache.chain_root(first) == ROOT and cache.chain_root(second) == ROOT


def test_insert_keys_skips_released_entries() -> None:
    pool, cache = make_cache()
    table = pool.allocate(3)
    keys = chain(TOKENS)
    pool.release(table[:1])
    table[0] = -1  # a sliding group gave its first block back
    assert cache.insert_keys(table, TOKENS, ROOT, keys, 0) == 2
    assert [cache.cached_info(b).key for b in table[1:]] == keys[1:]
    assert cache.lookup(keys[0]) is None


def test_insert_keys_with_caching_off_registers_nothing() -> None:
    pool, cache = make_cache(enabled=False)
    table = pool.allocate(3)
    assert cache.insert_keys(table, TOKENS, ROOT, chain(TOKENS), 0) == 0
    assert cache.num_cached_blocks == 0 and all(cache.cached_info(b) is None for b in table)


def test_cached_rows_are_a_tails_tokens_or_the_whole_block() -> None:
    pool, cache = make_cache()
    table = pool.allocate(2)
    cache.insert(table, TOKENS[:3], ROOT, 2)
    assert cache.cache_tail(table[1], cache.cached_info(table[0]).key, TOKENS[2:3])
    pool.release(table)
    assert cache.cached_rows(table[0]) == 2 and cache.cached_rows(table[1]) == 1


def test_freeing_a_block_in_use_is_refused_and_says_so() -> None:
    pool, _ = make_cache()
    [block] = pool.allocate(1)
    with pytest.raises(InputError) as caught:
        pool.free_evicted(block)
    assert str(caught.value) == f"block {block} is in use: only unreferenced blocks can be freed"
    assert pool.ref_counts[block] == 1 and pool.num_free_blocks == pool.num_blocks - 1
