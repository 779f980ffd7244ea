"""KV-cache groups at run time: a hybrid model's layer types each own a block pool (vLLM's hybrid allocator).

A model whose layers attend over different windows (Gemma 2/3: sliding layers beside full ones) is split into
one group per distinct window, as `kvlab memory` groups it (kvlab/cache/kv_spec.py `kv_cache_groups`, so
sizing and allocation cannot disagree). Each group has its own BlockPool holding only its layers' K/V, its
own PrefixCache and its own KVBounds; a sequence has one block table per group (`Sequence.block_tables`,
group 0's is `block_table`). Group 0 is the full-attention group when there is one. A sliding group's bounds
give back the blocks wholly before every future query's window (KVBounds.trim, the rule Mistral-style
all-sliding models already follow), so such a group holds at most `window_max_blocks` blocks a sequence.

The scheduler allocates, grows, forks and releases every group's table together, and admits or preempts
by what each group needs. A prefix hit follows vLLM's rule for hybrid models (HybridKVCacheCoordinator):
a hit of h blocks counts only if group 0 holds blocks [0, h) and every other group holds the blocks its
window still sees at position h * block_size, all registered under the same chain keys (`longest_hit`).
A model whose every layer has the same window is one group: the engine runs exactly as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence as Seq

from kvlab.cache.kv_spec import KVCacheGroup, kv_cache_groups, model_config_specs
from kvlab.cache.paged import BlockPool
from kvlab.config import ModelConfig
from kvlab.engine.kv_bounds import NULL_BLOCK, KVBounds
from kvlab.engine.request import Sequence
from kvlab.prefix.prefix_cache import PrefixCache


def layer_groups(config: ModelConfig) -> list[KVCacheGroup]:
    """The model's KV-cache groups (layers of equal spec), the full-attention group first."""
    groups = kv_cache_groups(model_config_specs(config))
    return sorted(groups, key=lambda g: getattr(g.spec, "sliding_window", None) is not None)


def group_window(group: KVCacheGroup) -> int | None:
    """The window of a group's layers (None: full attention)."""
    return getattr(group.spec, "sliding_window", None)


@dataclass(eq=False)
class CacheGroup:
    """One KV-cache group at run time (vLLM's SingleTypeKVCacheManager): its layers, pool, prefix cache and
    the bounds that trim its block tables."""

    index: int
    window: int | None
    layers: tuple[int, ...]
    pool: BlockPool
    prefix_cache: PrefixCache
    bounds: KVBounds

    def table(self, seq: Sequence) -> list[int]:
        return seq.block_tables[self.index]

    def held(self, seq: Sequence) -> list[int]:
        """The blocks `seq` holds in this group (released entries left out)."""
        return [b for b in seq.block_tables[self.index] if b != NULL_BLOCK]


class GroupedKV:
    """The model's per-layer K/V storage (PagedKV) over every group's pool: layer l's arrays are those of
    the pool of its group, so PagedAttention reads each layer through its group's block tables."""

    def __init__(self, groups: Seq[CacheGroup], num_layers: int) -> None:
        self.key_cache: list[object] = [None] * num_layers
        self.value_cache: list[object] = [None] * num_layers
        for group in groups:
            for local, layer in enumerate(group.layers):
                self.key_cache[layer] = group.pool.key_cache[local]
                self.value_cache[layer] = group.pool.value_cache[local]


def longest_hit(groups: Seq[CacheGroup], seq: Sequence, keys: Seq[bytes]) -> tuple[int, list[list[int]]]:
    """vLLM's hybrid prefix rule: the most blocks h <= len(keys) (group 0 hit blocks [0, len(keys)) under
    `keys`) such that every other group holds, under the same keys, the blocks [first, h) its window still
    sees at position h * block_size. Returns h and, per group other than 0, its blocks [first, h)."""
    size = groups[0].pool.block_size
    for h in range(len(keys), 0, -1):
        found: list[list[int]] = []
        for group in groups[1:]:
            first = group.bounds.first_visible_block(seq, h * size)
            blocks = [_verified(group.prefix_cache, key, seq.token_ids[i * size:(i + 1) * size])
                      for i, key in enumerate(keys[first:h], start=first)]
            if None in blocks:
                break
            found.append(blocks)
        else:
            return h, found
    return 0, [[] for _ in groups[1:]]


def _verified(cache: PrefixCache, key: bytes, token_ids: Seq[int]) -> int | None:
    """The block cached under `key` if it holds exactly `token_ids` (never trusted on the key alone)."""
    block = cache.lookup(key)
    info = None if block is None else cache.cached_info(block)
    return block if info is not None and info.token_ids == tuple(int(t) for t in token_ids) else None
