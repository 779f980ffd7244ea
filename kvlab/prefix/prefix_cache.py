"""The prefix cache across requests: full blocks found by chained key, verified token by token.

`match` walks a token list block by block from a root key and returns the cached blocks holding its
longest cached prefix; every hit is checked against the block's stored token ids and parent key, never
trusted on the hash alone. `insert` registers a request's newly computed full blocks. Storage, ref counts
and LRU eviction belong to the BlockPool; this module only decides keys and what counts as a hit.
"""

from __future__ import annotations

from typing import Any, Sequence

from kvlab.cache.paged import BlockPool
from kvlab.prefix.block_hash import block_key


class PrefixCache:
    """Chained-key lookup and registration of full blocks held in a BlockPool."""

    def __init__(self, pool: BlockPool, enabled: bool = True) -> None:
        self.pool = pool
        self.enabled = enabled
        self.listener: Any = None  # kvlab tier/events hook (issue 23): a kvlab.tier.listener.CacheListeners

    def match(self, token_ids: Sequence[int], root: bytes) -> tuple[list[int], list[bytes]]:
        """The cached blocks holding the longest prefix of `token_ids` (whole blocks), and their keys."""
        if not self.enabled:
            return [], []
        size = self.pool.block_size
        blocks: list[int] = []
        keys: list[bytes] = []
        parent = root
        for start in range(0, len(token_ids) - size + 1, size):
            chunk = tuple(int(t) for t in token_ids[start:start + size])
            key = block_key(parent, chunk)
            block = self.pool.lookup(key)
            if block is None:
                break
            info = self.pool.cached_info(block)
            if info is None or info.token_ids != chunk or info.parent != parent:
                break  # a hash collision or a stale entry: recompute rather than trust the key
            blocks.append(block)
            keys.append(key)
            parent = key
        if self.listener is not None:  # kvlab tier hook (issue 23): extend a local miss from the KV tier
            blocks, keys = self.listener.lookup(token_ids, root, blocks, keys)
        return blocks, keys

    def insert(self, block_table: Sequence[int], token_ids: Sequence[int], keys: list[bytes],
               root: bytes, num_computed_tokens: int) -> None:
        """Register the full, computed blocks of a block table that have no key yet.

        `keys` is the request's chain so far (extended in place), so each block is hashed once. A block whose
        key another block already holds stays unregistered (it is freed, not cached, when released).
        """
        if not self.enabled:
            return
        size = self.pool.block_size
        for index in range(len(keys), num_computed_tokens // size):
            parent = keys[-1] if keys else root
            chunk = token_ids[index * size:(index + 1) * size]
            key = block_key(parent, chunk)
            registered = self.pool.register(block_table[index], key, parent, chunk)
            if registered and self.listener is not None:  # kvlab tier/events hook (issue 23): write-through
                self.listener.on_block_stored(block_table[index], key, parent, chunk, root)
            keys.append(key)
