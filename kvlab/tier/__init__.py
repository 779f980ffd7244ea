"""A K/V tier behind the prefix cache: Redis/Valkey shared across instances, or a folder on disk.

keys.py (tier keys), codec.py (one value per block, verified on read), block_io.py (a pool block as
arrays), backend.py + redis_tier.py + file_tier.py + url.py (where blocks live), health.py (a failed tier
is skipped for a while), writer.py (the bounded write-through queue), stats.py (counters), tier.py (KVTier:
store and lookup), listener.py (what the prefix cache and pool call: the tier and the KV events).
"""
