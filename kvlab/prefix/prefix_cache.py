"""The prefix cache across requests: full blocks found by chained key, verified token by token.

One object owns everything about reuse (SGLang radix_cache's small API): the registry (key -> block, block
-> what was registered), the LRU of unreferenced cached blocks, hit statistics and a lock. The BlockPool
below it only allocates and counts references; the cache attaches itself to the pool as its Evictor, so a
block whose last reference drops stays findable (evictable) and the pool takes the least recently used one
back when it runs dry.

- `match(token_ids, root)`: the cached blocks holding the longest prefix, in whole blocks. Every hit is
  checked against the block's stored token ids and parent key, never trusted on the hash alone.
- `insert(block_table, token_ids, root, num_computed_tokens, known_keys)`: register newly full, computed
  blocks; returns the new keys and how many were already there (held by another block: left unregistered,
  so they are freed, not cached, when released).
- `cache_tail(block, parent, token_ids)` / `match_tail(token_ids, parent, start)`: a finished sequence's
  partially filled last block, kept (evictable, never referenced) and found by its rows' tokens, so a
  conversation's next turn reuses every row of the last one, not only its whole blocks (SGLang's radix cache
  matches token by token; vLLM's block hashes only whole blocks). A hit is copied into a private block, so a
  cached tail is never written again. Tails are not announced to the listeners: a tier or the router keeps
  whole blocks only.
- `evict_all()`, `evictable_size` / `protected_size`, `check_invariants`.

Two hook points for a shared K/V tier (kvlab's issue 23), on `PrefixCacheListener`: `block_stored` after a
full block is registered (publish it), `block_removed` when one is evicted, and `prefix_miss` when a local
match stops short (the tier may load the next blocks into the pool and `register` them; the match then
continues from where it stopped).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import NamedTuple, Protocol, Sequence

from kvlab.cache.paged import BlockPool
from kvlab.errors import InputError
from kvlab.prefix.block_hash import block_key


@dataclass(frozen=True)
class CachedBlock:
    """What was registered for a full block: its key, its parent's key and its token ids."""

    key: bytes
    parent: bytes | None
    token_ids: tuple[int, ...]


class Inserted(NamedTuple):
    """What `insert` did: the keys of the blocks it looked at (in table order) and how many of those keys
    another block already held (what was already there)."""

    keys: list[bytes]
    existing: int


_NOTHING = Inserted([], 0)


class PrefixCacheListener(Protocol):
    """Hooks for a tier beside the local cache (e.g. a shared K/V store); every method may do nothing."""

    def block_stored(self, block: int, info: CachedBlock) -> None:
        """A full, computed block was registered under `info.key` (after every layer wrote it)."""

    def block_removed(self, info: CachedBlock) -> None:
        """A cached block was evicted: its key no longer finds anything here."""

    def prefix_miss(self, cache: "PrefixCache", token_ids: Sequence[int], parent: bytes, start: int,
                    hit: Sequence[int]) -> None:
        """The local match stopped at token `start` (a block boundary) under `parent`, after the blocks
        `hit`. A tier may allocate blocks (holding `hit` meanwhile, so the LRU does not hand them out),
        write their K/V, `cache.register` them and release them; the match then continues."""


class PrefixCache:
    """Chained-key registry, LRU and statistics of the full blocks held in a BlockPool."""

    def __init__(self, pool: BlockPool, enabled: bool = True) -> None:
        self.pool = pool
        self.enabled = enabled
        self.listeners: list[PrefixCacheListener] = []
        self.queries = 0  # prompt tokens looked up, every admission
        self.hits = 0     # of those, tokens found
        self._cached: dict[bytes, int] = {}                      # key -> block
        self._block_info: dict[int, CachedBlock] = {}            # block -> what was registered
        self._evictable: OrderedDict[int, None] = OrderedDict()  # ref 0 and cached, LRU first
        self._roots: set[bytes] = set()  # chain roots seen: a block whose parent is one starts a chain
        self._tails: dict[bytes, dict[tuple[int, ...], int]] = {}  # parent key -> {rows' tokens: block}
        self._tail_info: dict[int, tuple[bytes, tuple[int, ...]]] = {}  # block -> (parent key, tokens)
        self._children: dict[bytes | None, set[int]] = {}  # parent key -> its cached full blocks
        self._lock = threading.RLock()   # the engine drives one thread; a shared tier may call from another
        if enabled:
            pool.attach(self)

    # --- lookup --------------------------------------------------------------------------------------------
    def match(self, token_ids: Sequence[int], root: bytes) -> tuple[list[int], list[bytes]]:
        """The cached blocks holding the longest prefix of `token_ids` (whole blocks), and their keys."""
        if not self.enabled:
            return [], []
        with self._lock:
            blocks: list[int] = []
            keys: list[bytes] = []
            self._walk(token_ids, root, blocks, keys)
            if self.listeners and (len(blocks) + 1) * self.pool.block_size <= len(token_ids):
                self._roots.add(root)  # what a listener registers here hangs from it (chain_root traces it)
                for listener in self.listeners:
                    listener.prefix_miss(self, token_ids, keys[-1] if keys else root,
                                         len(blocks) * self.pool.block_size, blocks)
                self._walk(token_ids, root, blocks, keys)
            return blocks, keys

    def _walk(self, token_ids: Sequence[int], root: bytes, blocks: list[int], keys: list[bytes]) -> None:
        """Extend (blocks, keys) block by block while the next block is cached and verified."""
        size = self.pool.block_size
        parent = keys[-1] if keys else root
        for start in range(len(blocks) * size, len(token_ids) - size + 1, size):
            chunk = tuple(int(t) for t in token_ids[start:start + size])
            key = block_key(parent, chunk)
            block = self._cached.get(key)
            if block is None:
                return
            info = self._block_info.get(block)
            if info is None or info.token_ids != chunk or info.parent != parent:
                return  # a hash collision or a stale entry: recompute rather than trust the key
            blocks.append(block)
            keys.append(key)
            parent = key

    def match_tail(self, token_ids: Sequence[int], parent: bytes, start: int) -> tuple[int, int] | None:
        """(block, rows) of the cached block under `parent` — a tail, or a full block that parts from
        `token_ids` inside it — sharing the most leading tokens with `token_ids[start:]` (the rows of a
        block depend only on the tokens up to them; of equally long ones, the tail cached first, tails before
        full blocks), or None when none shares the first."""
        with self._lock:
            best: tuple[int, int] | None = None
            candidates = [(tokens, block) for tokens, block in self._tails.get(parent, {}).items()]
            candidates += [(self._block_info[block].token_ids, block) for block in self._children.get(parent, ())]
            for tokens, block in candidates:
                rows = 0
                for mine, theirs in zip(tokens, token_ids[start:start + len(tokens)]):
                    if mine != int(theirs):
                        break
                    rows += 1
                if rows and (best is None or rows > best[1]):
                    best = (block, rows)
            return best

    def cache_tail(self, block: int, parent: bytes, token_ids: Sequence[int]) -> bool:
        """Keep `block`, a releasing sequence's partially filled last block whose first rows hold `token_ids`
        after the chain `parent`, findable by `match_tail` once released. False (nothing kept) when caching
        is off, another sequence still references the block or the same rows are cached already."""
        tokens = tuple(int(t) for t in token_ids)
        with self._lock:
            if not self.enabled or not 0 < len(tokens) < self.pool.block_size \
                    or self.pool.ref_counts[block] != 1 or block in self._block_info \
                    or tokens in self._tails.get(parent, {}):
                return False
            self._tails.setdefault(parent, {})[tokens] = block
            self._tail_info[block] = (parent, tokens)
            return True

    def cached_rows(self, block: int) -> int:
        """Rows of a cached block that hold K/V: a tail's tokens, else the whole block."""
        tail = self._tail_info.get(block)
        return len(tail[1]) if tail is not None else self.pool.block_size

    def lookup(self, key: bytes) -> int | None:
        return self._cached.get(key)

    def cached_info(self, block: int) -> CachedBlock | None:
        return self._block_info.get(block)

    def chain_parent(self, info: CachedBlock) -> bytes | None:
        """The parent key of a cached block, or None when the block starts a chain (its parent is a root)."""
        return None if info.parent is None or info.parent in self._roots else info.parent

    def chain_root(self, info: CachedBlock) -> bytes | None:
        """The root key (model, dtypes, salt) a cached block's chain hangs from; None if a link is gone."""
        with self._lock:
            parent, hops = info.parent, 0
            while parent is not None and parent not in self._roots and hops <= len(self._cached):
                block = self._cached.get(parent)
                above = None if block is None else self._block_info.get(block)
                parent, hops = (above.parent if above is not None else None), hops + 1
            return parent if parent in self._roots else None

    def record(self, num_queried: int, num_hit: int) -> None:
        """Count one admission's lookup: `num_queried` prompt tokens, `num_hit` of them found."""
        if self.enabled:
            self.queries += num_queried
            self.hits += num_hit

    # --- registration --------------------------------------------------------------------------------------
    def insert(self, block_table: Sequence[int], token_ids: Sequence[int], root: bytes,
               num_computed_tokens: int, known_keys: Sequence[bytes] = ()) -> Inserted:
        """Register the full, computed blocks of a block table beyond the `known_keys` it already has.

        Call it only once every layer has written the blocks (their K/V are then final). Returns the keys of
        the new full blocks (extend the caller's chain with them, so each block is hashed once) and how many
        of them another block already held (those stay unregistered: freed, not cached, when released).
        """
        size = self.pool.block_size
        if not self.enabled or num_computed_tokens // size <= len(known_keys):
            return _NOTHING
        with self._lock:
            self._roots.add(root)
            keys: list[bytes] = []
            existing = 0
            parent = known_keys[-1] if known_keys else root
            for index in range(len(known_keys), num_computed_tokens // size):
                chunk = token_ids[index * size:(index + 1) * size]
                key = block_key(parent, chunk)
                existing += not self.register(block_table[index], key, parent, chunk)
                keys.append(key)
                parent = key
            return Inserted(keys, existing)

    def insert_keys(self, block_table: Sequence[int], token_ids: Sequence[int], root: bytes,
                    keys: Sequence[bytes], start: int) -> int:
        """Register blocks [start, len(keys)) of a block table under chain `keys` already computed for these
        tokens (a hybrid model's other KV-cache groups take group 0's keys, so one hit finds every group's
        blocks: kvlab/engine/kv_groups.py). Released entries (< 0) are skipped. Returns how many were new."""
        if not self.enabled:
            return 0
        size = self.pool.block_size
        with self._lock:
            self._roots.add(root)
            registered = 0
            for index in range(start, len(keys)):
                if block_table[index] >= 0:
                    registered += self.register(block_table[index], keys[index], keys[index - 1] if index else root,
                                                token_ids[index * size:(index + 1) * size])
            return registered

    def register(self, block: int, key: bytes, parent: bytes | None, token_ids: Sequence[int]) -> bool:
        """Make a full in-use block findable under `key`. False (nothing changes) if the key is taken."""
        with self._lock:
            if key in self._cached or block in self._block_info:
                return False
            if self.pool.ref_counts[block] <= 0:
                raise InputError(f"block {block} is not in use: only computed blocks can be cached")
            info = CachedBlock(key, parent, tuple(int(t) for t in token_ids))
            self._cached[key] = block
            self._block_info[block] = info
            self._children.setdefault(parent, set()).add(block)
            for listener in self.listeners:
                listener.block_stored(block, info)
            return True

    # --- the pool's Evictor --------------------------------------------------------------------------------
    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def evictable_blocks(self) -> set[int]:
        return set(self._evictable)

    def hold(self, block: int) -> bool:
        with self._lock:
            if block not in self._block_info and block not in self._tail_info:
                return False
            self._evictable[block] = None
            return True

    def revive(self, block: int) -> bool:
        with self._lock:
            if block not in self._evictable:
                return False
            del self._evictable[block]
            return True

    def evict_lru(self) -> int:
        with self._lock:
            block, _ = self._evictable.popitem(last=False)
            self._forget(block)
            return block

    def evict_all(self) -> int:
        """Forget every evictable cached block (they become free); returns how many."""
        with self._lock:
            count = len(self._evictable)
            while self._evictable:
                self.pool.free_evicted(self.evict_lru())
            return count

    def _forget(self, block: int) -> None:
        if block in self._tail_info:  # a tail: never announced, so nothing to tell the listeners
            parent, tokens = self._tail_info.pop(block)
            del self._tails[parent][tokens]
            if not self._tails[parent]:
                del self._tails[parent]
            return
        info = self._block_info.pop(block)
        del self._cached[info.key]
        self._children[info.parent].discard(block)
        if not self._children[info.parent]:
            del self._children[info.parent]
        for listener in self.listeners:
            listener.block_removed(info)

    # --- sizes and checks ----------------------------------------------------------------------------------
    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered, in use or not."""
        return len(self._cached)

    @property
    def evictable_size(self) -> int:
        """Cached blocks nobody references (SGLang's evictable size), in blocks."""
        return len(self._evictable)

    @property
    def protected_size(self) -> int:
        """Cached blocks some request references (they cannot be evicted now), in blocks."""
        return len(self._block_info) + len(self._tail_info) - len(self._evictable)

    def check_invariants(self, free: set[int]) -> None:
        """Every evictable block is cached and unreferenced; no free block is registered; the two maps agree."""
        assert set(self._evictable) <= set(self._block_info) | set(self._tail_info), "an evictable block is not cached"
        assert set(self._tail_info) <= set(self._evictable), "a cached tail is referenced"
        assert not (free & set(self._tail_info)), "a free block is still a cached tail"
        assert {b: (p, t) for p, tails in self._tails.items() for t, b in tails.items()} == self._tail_info
        assert {b: self._block_info[b].parent for c in self._children.values() for b in c} \
            == {b: i.parent for b, i in self._block_info.items()}, "the children index disagrees"
        assert all(self.pool.ref_counts[b] == 0 for b in self._evictable), "an evictable block is referenced"
        assert not (free & set(self._block_info)), "a free block is still registered"
        assert {b: k for k, b in self._cached.items()} == {b: i.key for b, i in self._block_info.items()}
