"""KV cache storage: the Cache protocol, its backends and memory accounting."""

from kvlab.cache.base import Cache, CacheSpec, KVStore
from kvlab.cache.contiguous import ContiguousStore
from kvlab.cache.kv_cache import KVCache
from kvlab.cache.memory import MemoryReport, kv_bytes_per_token, kv_payload_bytes, tokens_in_budget

__all__ = ["Cache", "CacheSpec", "ContiguousStore", "KVCache", "KVStore", "MemoryReport",
           "kv_bytes_per_token", "kv_payload_bytes", "tokens_in_budget"]
