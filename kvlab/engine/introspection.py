"""What an engine can tell about itself: counters for /metrics and a picture of its pool for the explorer.

The runner and the output stage add to StepCounters (kvlab/engine/counters.py) as they work; `engine_stats`
and `cache_state` only read, so the server may call them between steps from its loop thread.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from kvlab.engine.request import Sequence, Status

if TYPE_CHECKING:  # the engine imports this module; only its type is needed here
    from kvlab.engine.engine import Engine


def group_stats(engine: "Engine") -> list[dict[str, Any]]:
    """Each KV-cache group (layer type, kvlab/engine/kv_groups.py): its window, layers, blocks and the bytes
    they hold, in use (referenced by a request) and allocated; group 0 is `block_pool`."""
    rows = []
    for group in engine.kv_groups:
        pool = group.pool
        rows.append({"group": group.index, "window": group.window,
                     "layer_type": "full_attention" if group.window is None else "sliding_attention",
                     "num_layers": len(group.layers), "num_blocks": pool.num_blocks,
                     "num_free_blocks": pool.num_free_blocks, "num_used_blocks": pool.num_used_blocks,
                     "num_cached_blocks": pool.num_evictable_blocks, "bytes_per_block": pool.bytes_per_block,
                     "used_bytes": pool.num_used_blocks * pool.bytes_per_block,
                     "capacity_bytes": pool.capacity_bytes})
    return rows


def engine_stats(engine: "Engine") -> dict[str, Any]:
    """Pool usage, prefix-cache hits, queue sizes and token counters (vLLM's metric names); usage is the
    share of every group's bytes in use (one group: of its blocks), and `kv_cache_groups` says it per group."""
    pool, sched, cache = engine.block_pool, engine.scheduler, engine.prefix_cache
    running = {s.request.request_id for s in sched.running}
    groups = group_stats(engine)
    return {
        "kv_cache_usage": sum(g["used_bytes"] for g in groups) / sum(g["capacity_bytes"] for g in groups),
        "prefix_cache_queries": cache.queries,
        "prefix_cache_hits": cache.hits,
        "num_preemptions": sched.num_preemptions,
        "num_running": len(running),
        "num_waiting": len(engine._requests) - len(running),
        "num_running_seqs": len(sched.running),
        "num_waiting_seqs": len(sched.waiting),
        "num_free_blocks": pool.num_free_blocks,
        "num_blocks": pool.num_blocks,
        **asdict(engine.counters),
        **(engine.cache_listener.stats() if engine.cache_listener is not None else {}),  # the KV tier
        "kv_cache_groups": groups,
    }


def cache_state(engine: "Engine") -> dict[str, Any]:
    """A JSON-serialisable picture of the pool: every used or cached block, every unfinished request."""
    pool, sched, cache = engine.block_pool, engine.scheduler, engine.prefix_cache
    size = pool.block_size
    owners: dict[int, tuple[Sequence, int]] = {}  # block -> (a sequence holding it, its index there)
    for seq in sched.running:
        for index, block in enumerate(seq.block_table):
            if block >= 0:  # not a released (NULL) entry
                owners.setdefault(block, (seq, index))
        for index, block in enumerate(seq.kv_view.sink_source if seq.kv_view is not None else ()):
            owners.setdefault(block, (seq, index))  # a policy's sink rows as computed
    blocks = []
    stored_tokens = 0
    for block in range(pool.num_blocks):
        info = cache.cached_info(block)
        if info is None and pool.ref_counts[block] == 0:
            continue
        if info is not None:
            tokens = list(info.token_ids)
            parent = cache.chain_parent(info)
            parent = None if parent is None else parent.hex()[:16]
        else:
            seq, index = owners[block]
            tokens = seq.token_ids[index * size:min((index + 1) * size, seq.num_computed_tokens)]
            parent = None
        stored_tokens += len(tokens)
        # the root key (model, dtypes, salt) the block hangs from: the server shows a salted block's
        # contents only to a caller with the same salt
        root = owners[block][0].request.root_key if block in owners else cache.chain_root(info)
        blocks.append({"id": block, "ref_count": pool.ref_counts[block],
                       "hash": info.key.hex()[:16] if info is not None else None, "parent": parent,
                       "num_tokens": len(tokens), "token_ids": [int(t) for t in tokens],
                       "root_key": root.hex() if root is not None else None})
    requests = []
    for request in engine._requests.values():
        for seq in request.seqs:
            if seq.status not in (Status.RUNNING, Status.WAITING):
                continue
            requests.append({
                "request_id": request.request_id, "index": seq.index, "status": seq.status.value,
                "num_prompt_tokens": request.num_prompt_tokens,
                "num_cached_tokens": request.num_cached_tokens,
                "num_tier_tokens": engine.cache_listener.tier_tokens(seq.block_keys)
                if engine.cache_listener is not None else 0,
                "num_computed_tokens": seq.num_computed_tokens,
                "num_output_tokens": len(seq.output_token_ids),
                # the blocks it holds; a window or policy has given back the first num_released_blocks
                "block_table": [b for b in seq.block_table if b >= 0],
                "num_released_blocks": sum(1 for b in seq.block_table if b < 0),
                # speculative decoding: guesses made and kept so far (the explorer shows the acceptance)
                "num_drafted_tokens": seq.num_drafted, "num_accepted_tokens": seq.num_accepted,
                "root_key": request.root_key.hex()})
    stats = engine_stats(engine)
    groups = stats["kv_cache_groups"]
    payloads = [stored_tokens * (pool.bytes_per_block // size)] + [
        _group_tokens(engine, g) * (g.pool.bytes_per_block // size) for g in engine.kv_groups[1:]]
    for row, payload in zip(groups, payloads):
        row["payload_bytes"] = payload
    # blocks and requests' tables are group 0's (the full-attention layers); the other groups' bytes are in
    # kv_cache_groups
    return {"block_size": size, "num_blocks": pool.num_blocks, "num_free_blocks": pool.num_free_blocks,
            "num_cached_blocks": pool.num_evictable_blocks, "num_used_blocks": pool.num_used_blocks,
            "payload_bytes": sum(payloads), "capacity_bytes": sum(g["capacity_bytes"] for g in groups),
            "kv_cache_groups": groups, "blocks": blocks, "requests": requests, "stats": stats}


def _group_tokens(engine: "Engine", group: Any) -> int:
    """Token rows a KV-cache group's blocks hold: the running sequences' computed rows in the blocks they
    still hold (a shared block once), plus every cached block nobody holds (full, or a tail's rows)."""
    size = group.pool.block_size
    rows: dict[int, int] = {}
    for seq in engine.scheduler.running:
        for index, block in enumerate(group.table(seq)):
            if block >= 0:
                rows[block] = max(rows.get(block, 0), min(size, max(seq.num_computed_tokens - index * size, 0)))
    cached = group.prefix_cache.evictable_blocks() if group.prefix_cache.enabled else set()
    return sum(rows.values()) + sum(group.prefix_cache.cached_rows(b) for b in cached - set(rows))
