"""Tier counters, shared by the engine thread (lookups) and the writer thread (writes)."""

from __future__ import annotations

import threading

# (Prometheus name after `kvlab:`, engine.stats() key, help); all counters (`_total` is added on export)
TIER_COUNTERS = [
    ("kv_tier_lookups", "kv_tier_lookups", "Local prefix misses looked up in the KV tier"),
    ("kv_tier_hit_blocks", "kv_tier_hit_blocks", "Blocks loaded from the KV tier"),
    ("kv_tier_hit_tokens", "kv_tier_hit_tokens", "Prompt tokens loaded from the KV tier"),
    ("kv_tier_read_bytes", "kv_tier_read_bytes", "Bytes read from the KV tier"),
    ("kv_tier_written_blocks", "kv_tier_written_blocks", "Blocks written to the KV tier"),
    ("kv_tier_written_bytes", "kv_tier_written_bytes", "Bytes written to the KV tier"),
    ("kv_tier_dropped_writes", "kv_tier_dropped_writes",
     "Blocks not written: the write queue was full or every tier was down"),
    ("kv_tier_refused_entries", "kv_tier_refused_entries",
     "Tier entries refused (corrupt, truncated, foreign, or not the block asked for) and recomputed"),
    ("kv_tier_errors", "kv_tier_errors", "Tier calls that failed (down, timed out): served locally"),
]


class TierStats:
    """Monotonic counters under a lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = {key: 0 for _, key, _ in TIER_COUNTERS}

    def add(self, key: str, amount: int = 1) -> None:
        with self._lock:
            self._counts[key] += amount

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)
