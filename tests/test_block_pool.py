"""BlockPool: allocation, ref counts, copy-on-write, accounting at idle (with a prefix cache holding blocks)."""

import numpy as np
import pytest
from hypothesis import given, strategies as st

from kvlab.cache.dtypes import resolve_kv_dtype
from kvlab.cache.paged import BlockPool, gather_blocks, slot_mapping, write_slots
from kvlab.errors import InputError
from kvlab.prefix.block_hash import block_key, root_key
from kvlab.prefix.prefix_cache import PrefixCache


def make_pool(num_blocks=8, block_size=4):
    return BlockPool(num_layers=2, num_kv_heads=2, head_dim=4, dtype=np.float64,
                     block_size=block_size, num_blocks=num_blocks)


def test_arrays_allocated_once_with_block_layout():
    pool = make_pool(num_blocks=5, block_size=3)
    assert len(pool.key_cache) == 2 and pool.key_cache[0].shape == (5, 2, 3, 4)
    assert pool.capacity_bytes == 2 * 2 * 5 * 2 * 3 * 4 * 8
    assert pool.bytes_per_block * pool.num_blocks == pool.capacity_bytes
    assert pool.num_free_blocks == 5 and pool.blocks_for(7) == 3


def test_allocate_release_and_refcounts():
    pool = make_pool()
    a = pool.allocate(3)
    assert len(set(a)) == 3 and pool.num_free_blocks == 5 and pool.num_used_blocks == 3
    pool.acquire(a[:1])
    assert pool.ref_counts[a[0]] == 2
    pool.release(a)
    assert pool.num_free_blocks == 7
    pool.release(a[:1])
    assert pool.num_free_blocks == 8
    pool.check_invariants()
    with pytest.raises(InputError, match="released more often"):
        pool.release(a[:1])
    with pytest.raises(InputError, match="only 8 are free"):
        pool.allocate(9)
    assert pool.num_free_blocks == 8
    with pytest.raises(InputError, match="is free"):
        pool.acquire([0])


def test_copy_block_copies_rows_of_every_layer():
    pool = make_pool()
    src, dst = pool.allocate(2)
    rng = np.random.default_rng(0)
    for arrays in (pool.key_cache, pool.value_cache):
        for layer in arrays:
            layer[src] = rng.standard_normal(layer[src].shape)
    pool.copy_block(src, dst, 3)
    for arrays in (pool.key_cache, pool.value_cache):
        for layer in arrays:
            np.testing.assert_array_equal(layer[dst, :, :3], layer[src, :, :3])


def filled_pool(dtype="float64", num_blocks=4, block_size=4) -> BlockPool:
    """A pool whose every row of every block and layer holds its own random K/V (a row copied over another
    is seen)."""
    fmt = resolve_kv_dtype(dtype, np.float64)
    pool = BlockPool(2, 2, 4, fmt, block_size, num_blocks, compute_dtype=np.float64)
    rng = np.random.default_rng(3)
    slots = np.arange(num_blocks * block_size)
    for keys, values in zip(pool.key_cache, pool.value_cache):
        write_slots(keys, values, slots, *(rng.standard_normal((slots.size, 2, 4)) for _ in range(2)))
    return pool


def rows_of(pool: BlockPool, block: int) -> list[np.ndarray]:
    """Every layer's keys and values of `block`, all its rows, as the pool reads them: [H_kv, block_size, d]."""
    table = np.array([[block]])
    return [gather_blocks(layer, table, pool.block_size)[0] for layer in pool.key_cache + pool.value_cache]


@pytest.mark.parametrize("dtype", ["float64", "int8"])
def test_copy_block_copies_the_first_rows_and_leaves_the_rest(dtype):
    """copy_block(src, dst, n) copies rows [0, n) of every layer, float or quantized (codes with their scales),
    and leaves dst's rows from n on as they were: copy-on-write copies only the rows written so far."""
    pool = filled_pool(dtype)
    src, dst = pool.allocate(2)
    before_src, before_dst = rows_of(pool, src), rows_of(pool, dst)
    pool.copy_block(src, dst, 3)
    for got, was_src, was_dst in zip(rows_of(pool, dst), before_src, before_dst):
        np.testing.assert_array_equal(got[:, :3], was_src[:, :3])
        np.testing.assert_array_equal(got[:, 3:], was_dst[:, 3:])
        assert not np.array_equal(was_src[:, 3:], was_dst[:, 3:])  # a copied row 3 would show
    for got, was in zip(rows_of(pool, src), before_src):
        np.testing.assert_array_equal(got, was)


def test_make_private_gives_a_shared_block_a_copy_of_its_written_rows():
    """make_private(table, i, n): a block another table shares is swapped for a fresh one holding its first n
    rows (the rest left as the fresh block had them), the shared block keeping one reference less."""
    pool = filled_pool()
    table = pool.allocate(2)
    pool.acquire(table[1:])  # a fork shares the partial last block
    shared = table[1]
    before_shared = rows_of(pool, shared)
    fresh = 2  # the free list's next block
    before_fresh = rows_of(pool, fresh)
    pool.make_private(table, 1, 2)
    assert table[1] == fresh and pool.ref_counts[shared] == 1 and pool.ref_counts[fresh] == 1
    for got, was_shared, was_fresh in zip(rows_of(pool, fresh), before_shared, before_fresh):
        np.testing.assert_array_equal(got[:, :2], was_shared[:, :2])
        np.testing.assert_array_equal(got[:, 2:], was_fresh[:, 2:])
    for got, was in zip(rows_of(pool, shared), before_shared):
        np.testing.assert_array_equal(got, was)
    pool.check_invariants()


def test_slot_mapping_gives_int64_slots_whatever_the_tables_type():
    """Slots are block * block_size + offset in int64: for an empty table (np.asarray alone makes it float64,
    which indexes nothing) and for a narrow NumPy table whose slots pass its type's range."""
    empty = slot_mapping([], 0, 0, 4)
    assert empty.dtype == np.int64 and empty.shape == (0,)
    slots = slot_mapping(np.array([300, 2], dtype=np.int16), 126, 3, 128)
    assert slots.dtype == np.int64 and slots.tolist() == [300 * 128 + 126, 300 * 128 + 127, 2 * 128]
    assert slot_mapping([7, 3], 1, 3, 2).tolist() == [7 * 2 + 1, 3 * 2, 3 * 2 + 1]  # positions 1, 2, 3


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "4"])
def test_bad_sizes_refused(bad):
    with pytest.raises(InputError):
        BlockPool(2, 2, 4, np.float32, block_size=bad, num_blocks=4)
    with pytest.raises(InputError):
        BlockPool(2, 2, 4, np.float32, block_size=4, num_blocks=bad)


@given(st.lists(st.tuples(st.sampled_from(["alloc", "acquire", "release", "register", "evict"]),
                          st.integers(0, 5)), max_size=60))
def test_random_operations_keep_the_pool_balanced(ops):
    pool = make_pool(num_blocks=6)
    cache = PrefixCache(pool)  # the registry and LRU of cached blocks are the prefix cache's
    tables: list[list[int]] = []
    key = 0
    for op, arg in ops:
        if op == "alloc" and arg <= pool.num_free_blocks:
            tables.append(pool.allocate(arg))
        elif op == "acquire" and tables:
            table = tables[arg % len(tables)]
            pool.acquire(table)
            tables.append(list(table))
        elif op == "release" and tables:
            pool.release(tables.pop(arg % len(tables)))
        elif op == "register" and tables and tables[arg % len(tables)]:
            key += 1
            cache.register(tables[arg % len(tables)][0], key.to_bytes(32, "little"), None, [key])
        elif op == "evict":
            cache.evict_all()
        pool.check_invariants()
        assert pool.num_used_blocks == len({b for t in tables for b in t})
    for table in tables:
        pool.release(table)
    pool.check_invariants()
    assert pool.num_free_blocks == pool.num_blocks


def test_paged_store_runs_the_plain_forward_and_forks_copy_on_write():
    from kvlab import KVCache, TinyLlama
    from paged_store import PagedStore
    model = TinyLlama(seed=2, backend="numpy")  # one attention path for both stores: bit-equal rows expected
    c = model.config
    pool = BlockPool(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, np.float64, 4, 16)
    ids = np.array([list(range(3, 14))])
    paged = KVCache(model.cache_spec, store=PagedStore(pool))
    plain = model.forward(ids[:, :7], use_cache=True).cache
    model.forward(ids[:, :7], cache=paged, use_cache=True)
    for cache in (plain, paged):
        model.forward(ids[:, 7:], cache=cache, use_cache=True)
    for (k1, v1), (k2, v2) in zip(plain, paged):
        np.testing.assert_array_equal(k1, k2)
        np.testing.assert_array_equal(v1, v2)
    assert pool.num_used_blocks == 3  # 11 tokens in blocks of 4
    fork = paged.fork()  # shares the two full blocks, copies the partial third
    assert pool.num_used_blocks == 4 and max(pool.ref_counts) == 2
    saved = [k.copy() for k, _ in fork]
    paged.crop(5)  # rewriting position 5 must not touch the fork's block
    model.forward(np.array([[99, 98]]), cache=paged, use_cache=True)
    assert all(np.array_equal(k, s) for (k, _), s in zip(fork, saved))
    second = paged.fork()
    got = model.forward(np.array([[7]]), cache=second, use_cache=True).logits[0, -1]
    full = model.forward(np.array([list(range(3, 8)) + [99, 98, 7]])).logits[0, -1]
    np.testing.assert_allclose(got, full, atol=1e-10)
    for cache in (paged, fork, second):
        cache.store.release()
    pool.check_invariants()
    assert pool.num_free_blocks == pool.num_blocks


# --- invariant checks, one corruption at a time -------------------------------------------------------------
# The pool's and the prefix cache's invariant checks (ARCHITECTURE.md invariant 7) catch each kind of broken
# bookkeeping, one at a time, and name it: every engine test leans on `check_invariants`, so a check that
# stopped seeing one kind of corruption would let that bug through everywhere.

ROOT = root_key("d" * 64, np.float64, np.float64)


def make(cached: bool = True) -> tuple[BlockPool, PrefixCache | None]:
    pool = BlockPool(1, 1, 2, np.float64, block_size=2, num_blocks=6)
    return pool, (PrefixCache(pool) if cached else None)


def broken(check, message: str | None = None) -> None:
    with pytest.raises(AssertionError) as caught:
        check()
    if message is not None:
        assert str(caught.value) == message
    else:
        assert not str(caught.value)  # the checks without a message name none


def test_a_sound_pool_and_cache_pass() -> None:
    pool, cache = make()
    table = pool.allocate(2)
    cache.insert(table, [1, 2, 3, 4], ROOT, 4)
    pool.check_invariants()
    pool.release(table)
    pool.check_invariants()


def test_a_block_on_the_free_list_twice() -> None:
    pool, _ = make(cached=False)
    pool._free.append(pool._free[0])
    broken(pool.check_invariants, "a block is on the free list twice")


def test_a_negative_ref_count() -> None:
    pool, _ = make(cached=False)
    pool.ref_counts[pool._free[0]] = -1  # still on the free list, so in no other state
    broken(pool.check_invariants, "negative ref count")


def test_a_block_both_free_and_in_use() -> None:
    pool, _ = make(cached=False)
    [block] = pool.allocate(1)
    pool._free.append(block)
    broken(pool.check_invariants, "block in two states")


def evictable_block(pool, cache) -> int:
    """A block cached and released: evictable."""
    table = pool.allocate(1)
    cache.insert(table, [1, 2], ROOT, 2)
    pool.release(table)
    return table[0]


def test_a_block_both_free_and_evictable() -> None:
    pool, cache = make()
    pool._free.append(evictable_block(pool, cache))
    broken(pool.check_invariants, "block in two states")


def test_a_block_both_evictable_and_in_use() -> None:
    pool, cache = make()
    pool.ref_counts[evictable_block(pool, cache)] = 1
    broken(pool.check_invariants, "block in two states")


def test_a_leaked_block() -> None:
    pool, _ = make(cached=False)
    [block] = pool.allocate(1)
    pool.ref_counts[block] = 0  # dropped without going back on the free list
    broken(pool.check_invariants, "blocks leaked")


def test_the_pool_asks_its_evictor_to_check_itself() -> None:
    pool, cache = make()
    table = pool.allocate(1)
    cache.insert(table, [1, 2], ROOT, 2)
    pool.release(table)
    cache._children.clear()  # only the cache's own check sees this
    broken(pool.check_invariants, "the children index disagrees")


# --- the prefix cache's own checks, given the pool's free set ---------------------------------------------
def test_an_evictable_block_that_is_not_cached() -> None:
    pool, cache = make()
    [block] = pool.allocate(1)
    cache._evictable[block] = None
    broken(lambda: cache.check_invariants(set(pool._free)), "an evictable block is not cached")


def test_a_cached_tail_still_referenced() -> None:
    pool, cache = make()
    [block] = pool.allocate(1)
    assert cache.cache_tail(block, ROOT, [7])  # what a releasing sequence does just before releasing
    broken(lambda: cache.check_invariants(set(pool._free)), "a cached tail is referenced")
    pool.release([block])
    cache.check_invariants(set(pool._free))


def test_a_free_block_still_a_cached_tail() -> None:
    pool, cache = make()
    [block] = pool.allocate(1)
    cache.cache_tail(block, ROOT, [7])
    pool.release([block])
    broken(lambda: cache.check_invariants(set(pool._free) | {block}), "a free block is still a cached tail")


def test_the_tail_maps_disagree() -> None:
    pool, cache = make()
    [block] = pool.allocate(1)
    cache.cache_tail(block, ROOT, [7])
    pool.release([block])
    cache._tail_info[block] = (ROOT, (8,))
    broken(lambda: cache.check_invariants(set(pool._free)))


def test_an_evictable_block_still_referenced() -> None:
    pool, cache = make()
    table = pool.allocate(1)
    cache.insert(table, [1, 2], ROOT, 2)
    pool.release(table)
    pool.ref_counts[table[0]] = 1
    broken(lambda: cache.check_invariants(set(pool._free)), "an evictable block is referenced")


def test_a_free_block_still_registered() -> None:
    pool, cache = make()
    table = pool.allocate(1)
    cache.insert(table, [1, 2], ROOT, 2)
    broken(lambda: cache.check_invariants(set(pool._free) | {table[0]}), "a free block is still registered")


def test_the_key_maps_disagree() -> None:
    pool, cache = make()
    table = pool.allocate(2)
    cache.insert(table, [1, 2, 3, 4], ROOT, 4)
    key = block_key(ROOT, [1, 2])
    assert cache.lookup(key) == table[0]
    cache._cached[key] = table[1]  # the key now names the other registered block
    broken(lambda: cache.check_invariants(set(pool._free)))


@pytest.mark.parametrize("name", ["num_layers", "num_kv_heads", "head_dim", "block_size", "num_blocks"])
def test_a_pool_of_a_non_positive_size_is_refused_naming_it(name) -> None:
    """Each size the pool is built from must be a positive int: 0 or 2.5 is an InputError that names it."""
    sizes = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 4, "block_size": 4, "num_blocks": 8}
    for bad in (0, 2.5):
        with pytest.raises(InputError, match=rf"^{name} must be"):
            BlockPool(dtype=np.float32, **{**sizes, name: bad})


def test_a_second_evictor_is_refused_and_the_first_kept() -> None:
    """One prefix cache per pool: attaching a second evictor is an InputError that says so."""
    pool = BlockPool(2, 2, 4, np.float32, 4, 8)
    first = PrefixCache(pool)
    with pytest.raises(InputError, match=r"^this pool already has an evictor \(one prefix cache per pool\)$"):
        pool.attach(PrefixCache.__new__(PrefixCache))
    assert pool.evictor is first
