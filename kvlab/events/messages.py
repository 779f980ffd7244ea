"""vLLM's KV event maps, exactly the keys vllm-router accepts (an unknown key rejects a whole batch).

A batch is a msgpack array `[ts, events, data_parallel_rank]`; each event a map tagged "type". Block
hashes are only ids that link a block to its parent (the router matches the token ids against the
worker's own /tokenize answer), so a kvlab chain key is shortened to a non-negative 63-bit int, which
every msgpack decoder reads as a plain integer.
"""

from __future__ import annotations

from typing import Any, Sequence

MEDIUM = "GPU"  # vLLM's name for an engine's primary pool (routers weigh other media with penalties)


def block_hash(key: bytes) -> int:
    return int.from_bytes(key[:8], "big") >> 1


def block_stored(key: bytes, parent: bytes | None, token_ids: Sequence[int], block_size: int) -> dict[str, Any]:
    return {"type": "BlockStored", "block_hashes": [block_hash(key)],
            "parent_block_hash": None if parent is None else block_hash(parent),
            "token_ids": [int(t) for t in token_ids], "block_size": int(block_size), "lora_id": None,
            "medium": MEDIUM, "lora_name": None}


def block_removed(keys: Sequence[bytes]) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": [block_hash(k) for k in keys], "medium": MEDIUM}


def all_blocks_cleared() -> dict[str, Any]:
    return {"type": "AllBlocksCleared"}
