"""KVTier: full blocks written through to shared or disk tiers, and read back on a local prefix miss.

`store` is called by the prefix cache for each block it registers (prompt and generated blocks alike, as
soon as they are full and computed): it copies the block and queues it for the writer thread. `lookup`
runs on a local miss: it derives the chain keys of the prompt's remaining full blocks, asks the tiers (in
the order given) for the longest run of them, fetches that run in one round trip per tier, verifies each
entry (digest, key, parent, token ids, layout: kvlab/tier/codec.py), loads the good ones into free pool
blocks and registers them as cached blocks, so the scheduler takes them as ordinary prefix hits. A
refused entry ends the run there (the rest is recomputed) and is counted; a tier that fails is skipped
for a while (kvlab/tier/health.py); nothing here ever fails a request.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

from kvlab.prefix.block_hash import block_key
from kvlab.tier import block_io, codec
from kvlab.tier.backend import TierBackend, TierUnavailable
from kvlab.tier.health import TierLink
from kvlab.tier.keys import key_name, tier_key
from kvlab.tier.stats import TierStats
from kvlab.tier.url import open_backend
from kvlab.tier.writer import WriteQueue

log = logging.getLogger("kvlab.tier")

DEFAULT_QUEUE_BLOCKS = 1024


class KVTier:
    """One or more tiers (URLs or backends, tried in order) behind a BlockPool."""

    def __init__(self, tiers: Sequence[str | TierBackend], pool: Any,
                 queue_blocks: int = DEFAULT_QUEUE_BLOCKS) -> None:
        backends = [open_backend(t) if isinstance(t, str) else t for t in tiers]
        self.pool = pool
        self.block_size = pool.block_size
        self.layout = block_io.layout(pool)
        self.dtypes = block_io.part_dtypes(pool)
        self.links = [TierLink(b) for b in backends]
        self.stats = TierStats()
        self.writer = WriteQueue(self.links, self.stats, queue_blocks)
        self._loading: set[bytes] = set()  # chain keys `load_after` is registering right now

    @property
    def names(self) -> list[str]:
        return [link.backend.name for link in self.links]

    # --- write-through (engine thread: copy and queue, never wait) ---------------------------------------
    def store(self, block: int, key: bytes, parent: bytes, token_ids: Sequence[int]) -> None:
        """Queue block `block` (registered under chain `key`, child of `parent`) for every tier."""
        if key in self._loading:  # a block being loaded from the tiers: it is there already
            return
        if self.writer.full():
            self.stats.add("kv_tier_dropped_writes")
            return
        arrays = block_io.read_block(self.pool, block)
        tkey, tparent, tokens = tier_key(key, self.block_size), tier_key(parent, self.block_size), tuple(token_ids)
        layout = self.layout
        self.writer.submit(key_name(tkey), lambda: codec.encode(tkey, tparent, tokens, layout, arrays))

    # --- read on a local miss (engine thread, bounded by the backends' timeouts) ------------------------
    def load_after(self, cache: Any, token_ids: Sequence[int], parent: bytes, start: int,
                   hit: Sequence[int]) -> list[tuple[bytes, bytes, tuple[int, ...]]]:
        """Load the blocks after a local hit (`hit`, ending at token `start` under chain key `parent`) from
        the tiers into the pool and register them in the prefix cache `cache`.

        Returns (key, parent, token_ids) of each block loaded. Only blocks before the prompt's last token
        are looked up: that token is always computed.
        """
        pool, size = self.pool, self.block_size
        wanted = (len(token_ids) - 1) // size
        first = start // size
        if first >= wanted or not any(link.allows() for link in self.links):
            return []
        revived = sum(1 for b in hit if pool.ref_counts[b] == 0)
        room = pool.num_free_blocks - revived  # blocks we may fill without evicting the local hit
        chain: list[tuple[bytes, bytes, tuple[int, ...]]] = []
        for index in range(first, min(wanted, first + room)):
            chunk = tuple(int(t) for t in token_ids[index * size:(index + 1) * size])
            key = block_key(parent, chunk)
            if cache.lookup(key) is not None:
                break  # held locally past a gap: stop here rather than load a duplicate
            chain.append((key, parent, chunk))
            parent = key
        if not chain:
            return []
        self.stats.add("kv_tier_lookups")
        loaded = self._fetch(chain)
        if not loaded:
            return []
        pool.acquire(hit)  # held while allocating, so the LRU cannot hand out the local hit
        new = 0
        try:
            allocated = pool.allocate(len(loaded))
            self._loading = {key for key, _, _ in chain[:len(loaded)]}  # registered below: not written back
            try:
                for block, arrays, (key, parent, chunk) in zip(allocated, loaded, chain):
                    block_io.write_block(pool, block, arrays)
                    if not cache.register(block, key, parent, chunk):
                        break  # cannot happen (checked above); stop rather than hand out an unregistered block
                    new += 1
            finally:
                self._loading = set()
            pool.release(allocated)  # registered ones stay cached (evictable), like a finished request's
        finally:
            pool.release(hit)
        self.stats.add("kv_tier_hit_blocks", new)
        self.stats.add("kv_tier_hit_tokens", new * size)
        return chain[:new]

    def _fetch(self, chain: list[tuple[bytes, bytes, tuple[int, ...]]]) -> list[list[Any]]:
        """The verified arrays of the longest run of `chain` the tiers hold, each tier continuing the run."""
        names = [key_name(tier_key(key, self.block_size)) for key, _, _ in chain]
        loaded: list[list[Any]] = []
        for link in self.links:
            if len(loaded) == len(chain):
                break
            if not link.allows():
                continue
            pos = len(loaded)
            try:
                run = link.backend.run_length(names[pos:])
                values = link.backend.get_many(names[pos:pos + run]) if run else []
                link.succeeded()
            except TierUnavailable as exc:
                link.failed(exc)
                self.stats.add("kv_tier_errors")
                continue
            for value, (key, parent, chunk) in zip(values, chain[pos:pos + run]):
                if value is None:
                    break  # evicted between the lookup and the fetch: a miss
                self.stats.add("kv_tier_read_bytes", len(value))
                expected = codec.Expected(tier_key(key, self.block_size), tier_key(parent, self.block_size),
                                          chunk, self.layout, self.dtypes)
                try:
                    loaded.append(codec.decode(value, expected))
                except codec.TierEntryError as exc:
                    self.stats.add("kv_tier_refused_entries")
                    log.warning("kv tier %s: refused an entry, recomputing it: %s", link.backend.name, exc)
                    break
        return loaded

    # --- lifecycle ---------------------------------------------------------------------------------------
    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every queued block is written (tests, benchmarks)."""
        return self.writer.flush(timeout)

    def close(self, timeout: float) -> bool:
        """Drain the write queue within `timeout` (graceful shutdown) and close the backends."""
        drained = self.writer.close(timeout)
        for link in self.links:
            link.backend.close()
        return drained
