"""What the prefix cache reports to: the KV tier and the KV event publisher.

CacheListeners is a PrefixCacheListener (kvlab/prefix/prefix_cache.py), appended to the engine's
PrefixCache:
  - `block_stored`, after a full computed block is registered: write-through to the tier, and BlockStored;
  - `prefix_miss`, when the local match stops short: the tier loads the following blocks into the pool
    and registers them (they are announced as stored too: this instance now holds them);
  - `block_removed`, when a cached block is evicted or reset: BlockRemoved;
and the engine calls `on_cleared()` on reset_prefix_cache (AllBlocksCleared).
Salted chains stay apart: a salted block is written to the tier under its salted chain key (no one without
the salt can name it) but never announced as an event (the router would credit it to anyone). A block is
public when its parent is this engine's unsalted root or a public block.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from kvlab.errors import ConfigError
from kvlab.tier.stats import TIER_COUNTERS

# every counter the listeners add to engine.stats() (Prometheus name after `kvlab:`, key, help)
LISTENER_COUNTERS = TIER_COUNTERS + [
    ("kv_events_queued", "kv_events_queued", "KV cache events produced by the engine"),
    ("kv_events_sent", "kv_events_sent", "KV cache events sent on the ZMQ socket"),
    ("kv_events_batches", "kv_events_batches", "KV event batches sent (the next batch's sequence number)"),
]

if TYPE_CHECKING:  # imported lazily: redis-py and pyzmq are optional (the `tier` extra)
    from kvlab.events.publisher import KVEventPublisher
    from kvlab.tier.tier import KVTier


class CacheListeners:
    """Fans the prefix cache's and pool's notifications out to a KVTier and a KVEventPublisher."""

    def __init__(self, public_root: bytes, tier: "KVTier | None" = None,
                 events: "KVEventPublisher | None" = None) -> None:
        self.public_root = public_root  # the unsalted chain root of this engine's model and dtypes
        self.tier = tier
        self.events = events
        self._closed = False
        self._from_tier: set[bytes] = set()  # chain keys of cached blocks that were loaded from the tier
        self._public: set[bytes] = set()     # chain keys announced as BlockStored (unsalted chains)

    def _announce(self, key: bytes, parent: bytes | None, token_ids: Sequence[int]) -> None:
        public = parent == self.public_root or parent in self._public
        if self.events is not None and public:
            self._public.add(key)
            self.events.stored(key, None if parent == self.public_root else parent, token_ids)

    def block_stored(self, block: int, info: Any) -> None:
        if self.tier is not None:
            self.tier.store(block, info.key, info.parent, info.token_ids)
        self._announce(info.key, info.parent, info.token_ids)

    def prefix_miss(self, cache: Any, token_ids: Sequence[int], parent: bytes, start: int,
                    hit: Sequence[int]) -> None:
        if self.tier is None:
            return
        for key, _, _ in self.tier.load_after(cache, token_ids, parent, start, hit):
            self._from_tier.add(key)

    def block_removed(self, info: Any) -> None:
        self._from_tier.discard(info.key)
        if info.key in self._public:
            self._public.discard(info.key)
            if self.events is not None:
                self.events.removed(info.key)

    def tier_tokens(self, keys: Sequence[bytes]) -> int:
        """Tokens of a sequence's blocks (by chain key) that came from the tier: the explorer shows them."""
        size = self.tier.block_size if self.tier is not None else 0
        return sum(size for key in keys if key in self._from_tier)

    def on_cleared(self) -> None:
        self._public.clear()
        if self.events is not None:
            self.events.cleared()

    def stats(self) -> dict[str, int]:
        counts = self.tier.stats.snapshot() if self.tier is not None else {}
        if self.events is not None:
            counts.update(self.events.stats())
        return counts

    def close(self, timeout: float) -> None:
        """Drain the tier's writes within `timeout`, then stop the event publisher (once; later calls do nothing)."""
        if self._closed:
            return
        self._closed = True
        if self.tier is not None:
            self.tier.close(timeout)
        if self.events is not None:
            self.events.close()


def build_listeners(pool: Any, public_root: bytes, kv_tiers: Sequence[Any] | None,
                    kv_events_config: Any, prefix_caching: bool = True) -> CacheListeners | None:
    """The engine's listeners for `kv_tiers` (URLs or backends) and `kv_events_config`; None if neither."""
    from kvlab.events.config import KVEventsConfig

    if kv_tiers is not None and (isinstance(kv_tiers, (str, bytes)) or not isinstance(kv_tiers, (list, tuple))):
        raise ConfigError(f"kv_tiers must be a list of tier URLs, got {kv_tiers!r}")
    events_config = KVEventsConfig.parse(kv_events_config)
    if not kv_tiers and not events_config.enabled:
        return None
    if not prefix_caching:
        raise ConfigError("a KV tier and KV events work on the prefix cache: they need prefix caching on")
    tier = events = None
    if kv_tiers:
        from kvlab.tier.tier import KVTier
        tier = KVTier(list(kv_tiers), pool)
    if events_config.enabled:
        try:
            from kvlab.events.publisher import KVEventPublisher
        except ImportError as exc:
            raise ConfigError(f"KV events need pyzmq and msgpack ({exc.name} is missing): "
                              "pip install 'kvlab[tier]'") from None
        try:
            events = KVEventPublisher(events_config, pool.block_size)
        except ConfigError:
            if tier is not None:
                tier.close(0)
            raise
    return CacheListeners(public_root, tier, events)
