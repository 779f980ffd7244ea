"""The prefix cache across requests, below the engine: chained block keys and the registry of full blocks."""

from kvlab.prefix.block_hash import block_key, root_key
from kvlab.prefix.prefix_cache import CachedBlock, PrefixCache, PrefixCacheListener

__all__ = ["CachedBlock", "PrefixCache", "PrefixCacheListener", "block_key", "root_key"]
