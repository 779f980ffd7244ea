"""Prefix cache: chained SHA-256 keys, token-verified hits, salts and roots, registration of full blocks."""

import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, strategies as st

from kvlab.cache.paged import BlockPool
from kvlab.errors import InputError
from kvlab.prefix.block_hash import block_key, root_key
from kvlab.prefix.prefix_cache import PrefixCache

ROOT = root_key("f" * 64, np.float64, np.float64)


def make_cache(num_blocks=16, block_size=4):
    pool = BlockPool(1, 1, 2, np.float64, block_size, num_blocks)
    return pool, PrefixCache(pool)


def compute(pool, cache, tokens):
    """What the engine does after computing all of `tokens` for one request: allocate, register."""
    table = pool.allocate(pool.blocks_for(len(tokens)))
    keys = cache.insert(table, tokens, ROOT, len(tokens)).keys
    return table, keys


def test_keys_are_deterministic_across_processes_and_chain():
    code = ("import numpy as np; from kvlab.prefix.block_hash import block_key, root_key; "
            "print(block_key(root_key('f'*64, np.float64, np.float64), [1, 2, 3, 4]).hex())")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert other.strip() == block_key(ROOT, [1, 2, 3, 4]).hex()
    assert block_key(ROOT, [1, 2, 3, 4]) != block_key(block_key(ROOT, [0] * 4), [1, 2, 3, 4])
    assert block_key(ROOT, [1, 2]) != block_key(ROOT, [1, 2], extra_keys=["x"])
    assert len(block_key(ROOT, [1])) == 32


def test_root_separates_models_dtypes_and_salts():
    roots = {root_key("a" * 64, np.float64, np.float64), root_key("b" * 64, np.float64, np.float64),
             root_key("a" * 64, np.float32, np.float32), root_key("a" * 64, np.float32, np.float16),
             root_key("a" * 64, np.float64, np.float64, "tenant-1"),
             root_key("a" * 64, np.float64, np.float64, "tenant-2")}
    assert len(roots) == 6


def test_match_returns_full_blocks_of_the_longest_cached_prefix():
    pool, cache = make_cache()
    tokens = list(range(10))  # two full blocks + 2 tokens
    table, keys = compute(pool, cache, tokens)
    assert len(keys) == 2 and cache.num_cached_blocks == 2
    blocks, hit_keys = cache.match(tokens[:8] + [99, 98, 97, 96], ROOT)
    assert blocks == table[:2] and hit_keys == keys
    assert cache.match([0, 1, 2, 3, 9, 9, 9, 9], ROOT)[0] == table[:1]
    assert cache.match([5] + tokens[1:], ROOT)[0] == []
    assert cache.match(tokens, root_key("f" * 64, np.float64, np.float64, "salt"))[0] == []


def test_a_hit_is_verified_token_by_token():
    pool, cache = make_cache()
    table, keys = compute(pool, cache, [1, 2, 3, 4])
    # Forge a collision: the key of [5, 6, 7, 8] pointing at the block that holds [1, 2, 3, 4].
    cache._cached[block_key(ROOT, [5, 6, 7, 8])] = table[0]
    assert cache.match([5, 6, 7, 8], ROOT) == ([], [])


def test_disabled_cache_neither_matches_nor_registers():
    pool = BlockPool(1, 1, 2, np.float64, 4, 8)
    cache = PrefixCache(pool, enabled=False)
    table = pool.allocate(2)
    keys = cache.insert(table, list(range(8)), ROOT, 8).keys
    assert keys == [] and cache.num_cached_blocks == 0 and cache.match(list(range(8)), ROOT) == ([], [])


def test_duplicate_content_keeps_the_first_block():
    pool, cache = make_cache()
    first, _ = compute(pool, cache, [1, 2, 3, 4])
    second, keys = compute(pool, cache, [1, 2, 3, 4])
    assert len(keys) == 1 and cache.lookup(keys[0]) == first[0]
    pool.release(second)
    assert pool.num_evictable_blocks == 0  # the duplicate was freed, not cached
    pool.release(first)
    assert pool.num_evictable_blocks == 1
    pool.check_invariants()


@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=14), min_size=1, max_size=8))
def test_match_equals_longest_common_block_prefix(prompts):
    pool, cache = make_cache(num_blocks=64)
    seen = []
    for tokens in prompts:
        blocks, _ = cache.match(tokens, ROOT)
        expected = 0
        for other in seen:
            n = 0
            while n + 4 <= min(len(other), len(tokens)) and other[n:n + 4] == tokens[n:n + 4]:
                n += 4
            expected = max(expected, n)
        assert len(blocks) * 4 == expected
        compute(pool, cache, tokens)
        seen.append(tokens)
    pool.check_invariants()


def test_cached_blocks_are_evictable_lru_and_count_as_free():
    pool = BlockPool(num_layers=2, num_kv_heads=2, head_dim=4, dtype=np.float64, block_size=4, num_blocks=3)
    cache = PrefixCache(pool)  # moved from test_block_pool: the registry and LRU are the prefix cache's
    blocks = pool.allocate(3)
    for i, b in enumerate(blocks):
        assert cache.register(b, bytes([i]) * 32, None, [i] * 4)
    assert not cache.register(blocks[0], b"\x01" * 32, None, [1] * 4)  # key taken: nothing changes
    pool.release(blocks)  # tail first: blocks[2] is the least recently used
    assert pool.num_free_blocks == 3 and pool.num_evictable_blocks == 3
    pool.check_invariants()
    assert cache.lookup(b"\x00" * 32) == blocks[0]
    pool.acquire([blocks[0]])  # a hit takes it out of the LRU
    assert pool.num_free_blocks == 2
    [new] = pool.allocate(1)
    assert new == blocks[2] and cache.lookup(b"\x02" * 32) is None  # evicted, forgotten
    pool.check_invariants()
    pool.release([new, blocks[0]])
    assert cache.evict_all() == 2 and cache.num_cached_blocks == 0
    pool.check_invariants()


def test_insert_returns_new_keys_and_what_was_already_there():
    pool, cache = make_cache()
    tokens = list(range(12))
    first = pool.allocate(3)
    done = cache.insert(first, tokens, ROOT, 8)  # two of three blocks computed
    assert len(done.keys) == 2 and done.existing == 0
    more = cache.insert(first, tokens, ROOT, 12, done.keys)  # only the third is new; the caller's list is kept
    assert len(more.keys) == 1 and len(done.keys) == 2 and more.existing == 0
    assert cache.insert(first, tokens, ROOT, 12, done.keys + more.keys) == ([], 0)  # nothing new
    second = pool.allocate(3)
    again = cache.insert(second, tokens, ROOT, 12)
    assert again.keys == done.keys + more.keys and again.existing == 3  # the same content: already there
    assert (cache.evictable_size, cache.protected_size) == (0, 3)
    pool.release(first)
    assert (cache.evictable_size, cache.protected_size) == (3, 0)
    pool.release(second)
    assert pool.num_free_blocks == pool.num_blocks
    pool.check_invariants()


class Recorder:
    """A listener that records the hooks and, on a miss, supplies the missing block from a second copy."""

    def __init__(self, pool, tokens):
        self.pool, self.tokens, self.events = pool, tokens, []

    def block_stored(self, block, info):
        self.events.append(("stored", block, info.token_ids))

    def block_removed(self, info):
        self.events.append(("removed", info.token_ids))

    def prefix_miss(self, cache, token_ids, parent, start, hit):
        self.events.append(("miss", start))
        chunk = list(token_ids[start:start + 4])
        if chunk == self.tokens[start:start + 4]:
            [block] = self.pool.allocate(1)  # a shared tier would write the block's K/V here
            cache.register(block, block_key(parent, chunk), parent, chunk)
            self.pool.release([block])


def test_listener_hooks_see_stores_evictions_and_fill_a_local_miss():
    pool, cache = make_cache(num_blocks=4)
    tokens = list(range(8))
    listener = Recorder(pool, tokens)
    cache.listeners.append(listener)
    table, keys = compute(pool, cache, tokens[:4])
    assert listener.events == [("stored", table[0], tuple(tokens[:4]))]
    pool.release(table)
    blocks, hit_keys = cache.match(tokens, ROOT)  # the local cache holds block 0; the tier supplies block 1
    assert len(blocks) == 2 and blocks[0] == table[0] and hit_keys[0] == keys[0]
    assert ("miss", 4) in listener.events
    assert cache.match([9] * 8, ROOT) == ([], [])  # a miss the tier cannot fill stays a miss
    cache.evict_all()
    assert [e for e in listener.events if e[0] == "removed"] == [("removed", tuple(tokens[:4])),
                                                                  ("removed", tuple(tokens[4:]))]
    pool.check_invariants()


def test_blocks_a_listener_fills_in_trace_to_the_root_of_the_match() -> None:
    """Blocks a tier registers during a match, in a cache that never inserted under that root, start a chain
    of that root: chain_parent None for the first, chain_root the root for both."""
    pool, cache = make_cache(num_blocks=4)
    tokens = list(range(8))
    cache.listeners.append(Recorder(pool, tokens))  # it supplies one block per miss
    assert len(cache.match(tokens, ROOT)[0]) == 1
    blocks, keys = cache.match(tokens, ROOT)
    assert len(blocks) == 2 and keys == [block_key(ROOT, tokens[:4]), block_key(keys[0], tokens[4:])]
    first, second = (cache.cached_info(b) for b in blocks)
    assert cache.chain_parent(first) is None and cache.chain_parent(second) == keys[0]
    assert cache.chain_root(first) == ROOT and cache.chain_root(second) == ROOT
    pool.check_invariants()


def test_a_disabled_cache_leaves_the_pool_without_an_evictor():
    pool = BlockPool(1, 1, 2, np.float64, 4, 8)
    PrefixCache(pool, enabled=False)
    table = pool.allocate(2)
    pool.release(table)
    assert pool.evictor is None and pool.num_evictable_blocks == 0 and pool.num_free_blocks == 8


def test_hit_statistics_add_up_over_admissions():
    pool, cache = make_cache()
    cache.record(8, 4)
    cache.record(6, 2)
    assert (cache.queries, cache.hits) == (14, 6)


def test_acquiring_a_free_block_is_refused_with_a_cache_too():
    """A free block (never cached) is not revived: sharing it is an error, and nothing changes."""
    import pytest

    from kvlab.errors import InputError

    pool, cache = make_cache(num_blocks=4)
    table, _ = compute(pool, cache, [1, 2, 3, 4])
    free = [b for b in range(4) if b not in table]
    with pytest.raises(InputError, match=f"block {free[0]} is free"):
        pool.acquire([free[0]])
    assert pool.ref_counts[free[0]] == 0 and pool.num_free_blocks == 3
    assert not cache.revive(free[0]) and not cache.revive(table[0])  # in use: not evictable either


def test_invariant_checks_name_what_broke():
    import pytest

    pool, cache = make_cache(num_blocks=4)
    table, _ = compute(pool, cache, [1, 2, 3, 4])
    pool.release(table)
    cache.check_invariants(set())
    cache._evictable[3] = None  # an evictable block the registry does not know
    with pytest.raises(AssertionError, match="^an evictable block is not cached$"):
        cache.check_invariants(set())
    del cache._evictable[3]
    pool.ref_counts[table[0]] = 1  # evictable yet referenced
    with pytest.raises(AssertionError, match="^an evictable block is referenced$"):
        cache.check_invariants(set())
    pool.ref_counts[table[0]] = 0
    with pytest.raises(AssertionError, match="^a free block is still registered$"):
        cache.check_invariants({table[0]})


def test_listeners_are_asked_only_for_a_whole_block_past_the_local_hits():
    """A tier is asked to fill a miss only where the prompt holds a whole block beyond what matched
    locally (a partial tail is always recomputed, never fetched)."""
    pool, cache = make_cache(num_blocks=8)
    listener = Recorder(pool, [])   # fills nothing: only the questions are recorded
    cache.listeners.append(listener)
    table, _ = compute(pool, cache, [1, 2, 3, 4])
    listener.events.clear()
    assert cache.match([1, 2, 3], ROOT) == ([], [])           # less than a block: nothing to ask
    assert cache.match([1, 2, 3, 4, 5, 6, 7], ROOT)[0] == table  # one hit, then a partial block
    assert listener.events == []
    assert cache.match([1, 2, 3, 4, 5, 6, 7, 8], ROOT)[0] == table  # a whole block past the hit
    assert listener.events == [("miss", 4)]


# --- insert_keys, cached_rows, free_evicted -----------------------------------------------------------------
# PrefixCache and BlockPool calls the engine tests reach only through a hybrid model or a tier: registering
# blocks under keys already computed (`insert_keys`: what it registers, under which parent, what it counts),
# the rows a cached block holds (`cached_rows`), and what the pool says when asked to free a block in use.

KEYS_ROOT = root_key("e" * 64, np.float64, np.float64)
TOKENS = [1, 2, 3, 4, 5, 6, 7]  # three whole blocks of 2 and one more token


def small_cache(enabled: bool = True, num_blocks: int = 8) -> tuple[BlockPool, PrefixCache]:
    pool = BlockPool(1, 1, 2, np.float64, block_size=2, num_blocks=num_blocks)
    return pool, PrefixCache(pool, enabled=enabled)


def chain(tokens: list[int], root: bytes = KEYS_ROOT, size: int = 2) -> list[bytes]:
    keys, parent = [], root
    for start in range(0, len(tokens) - size + 1, size):
        parent = block_key(parent, tokens[start:start + size])
        keys.append(parent)
    return keys


def test_insert_keys_registers_from_start_under_each_blocks_parent_and_counts_them() -> None:
    pool, cache = small_cache()
    table = pool.allocate(3)
    keys = chain(TOKENS)
    assert cache.insert_keys(table, TOKENS, KEYS_ROOT, keys, 1) == 2  # blocks 1 and 2, not 0
    assert cache.cached_info(table[0]) is None
    assert [cache.cached_info(b).parent for b in table[1:]] == keys[:2]
    assert [cache.cached_info(b).key for b in table[1:]] == keys[1:]
    assert [cache.cached_info(b).token_ids for b in table[1:]] == [(3, 4), (5, 6)]
    assert cache.insert_keys(table, TOKENS, KEYS_ROOT, keys, 0) == 1  # only block 0 is new
    info = cache.cached_info(table[0])
    assert info.parent == KEYS_ROOT and info.key == keys[0]
    assert cache.insert_keys(table, TOKENS, KEYS_ROOT, keys, 0) == 0  # every key is taken
    assert cache.match(TOKENS, KEYS_ROOT) == (table, keys)
    pool.release(table)
    pool.check_invariants()


def test_insert_keys_marks_the_root_so_chains_are_traced_to_it() -> None:
    pool, cache = small_cache()
    table = pool.allocate(2)
    keys = chain(TOKENS[:4])
    assert cache.insert_keys(table, TOKENS, KEYS_ROOT, keys, 0) == 2
    first, second = (cache.cached_info(b) for b in table)
    assert cache.chain_parent(first) is None and cache.chain_parent(second) == keys[0]
    assert cache.chain_root(first) == KEYS_ROOT and cache.chain_root(second) == KEYS_ROOT


def test_insert_keys_skips_released_entries() -> None:
    pool, cache = small_cache()
    table = pool.allocate(3)
    keys = chain(TOKENS)
    pool.release(table[:1])
    table[0] = -1  # a sliding group gave its first block back
    assert cache.insert_keys(table, TOKENS, KEYS_ROOT, keys, 0) == 2
    assert [cache.cached_info(b).key for b in table[1:]] == keys[1:]
    assert cache.lookup(keys[0]) is None


def test_insert_keys_with_caching_off_registers_nothing() -> None:
    pool, cache = small_cache(enabled=False)
    table = pool.allocate(3)
    assert cache.insert_keys(table, TOKENS, KEYS_ROOT, chain(TOKENS), 0) == 0
    assert cache.num_cached_blocks == 0 and all(cache.cached_info(b) is None for b in table)


def test_cached_rows_are_a_tails_tokens_or_the_whole_block() -> None:
    pool, cache = small_cache()
    table = pool.allocate(2)
    cache.insert(table, TOKENS[:3], KEYS_ROOT, 2)
    assert cache.cache_tail(table[1], cache.cached_info(table[0]).key, TOKENS[2:3])
    pool.release(table)
    assert cache.cached_rows(table[0]) == 2 and cache.cached_rows(table[1]) == 1


def test_freeing_a_block_in_use_is_refused_and_says_so() -> None:
    pool, _ = small_cache()
    [block] = pool.allocate(1)
    with pytest.raises(InputError) as caught:
        pool.free_evicted(block)
    assert str(caught.value) == f"block {block} is in use: only unreferenced blocks can be freed"
    assert pool.ref_counts[block] == 1 and pool.num_free_blocks == pool.num_blocks - 1


# --- cached tails: what cache_tail refuses, what match_tail finds ------------------------------------------
# The unit cases behind token-granular reuse (tests/test_token_prefix_reuse.py runs it in the engine): each of
# cache_tail's refusals leaves nothing findable, and match_tail answers None for a block that shares no row.

def test_cache_tail_keeps_a_partial_block_and_refuses_each_block_it_must_not_keep() -> None:
    """cache_tail keeps 1..block_size-1 rows of a block only its releasing sequence holds; it refuses (False,
    nothing findable, the block freed on release) caching off, no rows, a full block's worth, a block another
    table holds, a registered full block, and rows cached already under the same parent."""
    pool, cache = make_cache()  # blocks of 4
    [kept] = pool.allocate(1)
    assert cache.cache_tail(kept, ROOT, [5, 6, 7])
    pool.release([kept])
    assert cache.match_tail([5, 6, 7, 1], ROOT, 0) == (kept, 3) and cache.cached_rows(kept) == 3
    assert pool.num_evictable_blocks == 1

    off_pool = BlockPool(1, 1, 2, np.float64, 4, 8)
    off = PrefixCache(off_pool, enabled=False)
    [block] = off_pool.allocate(1)
    assert off.cache_tail(block, ROOT, [5, 6, 7]) is False
    assert off.match_tail([5, 6, 7], ROOT, 0) is None and off.cached_rows(block) == 4

    for rows in ([], [1, 2, 3, 4]):  # no row; a whole block (full blocks are registered by key, not as tails)
        [block] = pool.allocate(1)
        assert cache.cache_tail(block, ROOT, rows) is False
        assert cache.cached_rows(block) == 4 and cache.match_tail([1, 2, 3, 4], ROOT, 0) is None
        pool.release([block])
        assert pool.num_evictable_blocks == 1  # freed, not kept

    [shared] = pool.allocate(1)
    pool.acquire([shared])  # a fork still reads it
    assert cache.cache_tail(shared, ROOT, [8, 9]) is False
    assert cache.match_tail([8, 9], ROOT, 0) is None and cache.cached_rows(shared) == 4
    pool.release([shared, shared])

    [full] = pool.allocate(1)
    assert cache.register(full, block_key(ROOT, [1, 2, 3, 4]), ROOT, [1, 2, 3, 4])
    assert cache.cache_tail(full, ROOT, [1, 2]) is False
    assert cache.cached_rows(full) == 4  # still the whole registered block, not a 2-row tail
    pool.release([full])

    [again] = pool.allocate(1)
    assert cache.cache_tail(again, ROOT, [5, 6, 7]) is False  # `kept` holds these rows already
    assert cache.match_tail([5, 6, 7], ROOT, 0) == (kept, 3) and cache.cached_rows(again) == 4
    pool.release([again])
    assert pool.num_evictable_blocks == 2  # `kept` and `full`
    pool.check_invariants()


def test_match_tail_needs_a_shared_first_row_and_breaks_ties_for_the_tail_cached_first() -> None:
    """No candidate sharing the first token after `start`: None, never a hit of 0 rows. Of equally long
    matches, the tail cached first is the one found."""
    pool, cache = make_cache()
    first, second = pool.allocate(2)
    assert cache.cache_tail(first, ROOT, [5, 6]) and cache.cache_tail(second, ROOT, [5, 7, 9])
    table, _ = compute(pool, cache, [1, 2, 3, 4])
    pool.release([first, second] + table)
    assert cache.match_tail([6, 5, 6], ROOT, 0) is None
    assert cache.match_tail([1, 2, 3, 4, 6, 5], ROOT, 4) is None  # start past the whole block: no shared row
    assert cache.match_tail([2, 3], ROOT, 0) is None  # the full block [1, 2, 3, 4] shares no first row either
    assert cache.match_tail([1, 2, 9], ROOT, 0) == (table[0], 2)  # a full block that parts inside it
    assert cache.match_tail([5, 7, 1], ROOT, 0) == (second, 2)
    assert cache.match_tail([5, 8], ROOT, 0) == (first, 1)  # a tie of one row: the earlier tail
    assert cache.match_tail([0, 5, 8], ROOT, 1) == (first, 1)
    pool.check_invariants()
