"""Session files in and out of the engine's prefix cache: `--prompt-cache FILE` and chat's /save and /load on
the one runtime.

A session file (kvlab/sessions/persist.py: safetensors, SHA-256 checked, refused when it is from another
model or dtype) holds one sequence's K/V rows and their token ids. Loading writes the file's rows into pool
blocks and registers them in the prefix cache: whole blocks under the chain keys a request for those tokens
computes, the rows after them as a cached tail (PrefixCache.cache_tail), so the next request finds all of
them as it finds any cached prefix. Saving reads the longest cached run of a token sequence's rows (whole
blocks, then a tail) back into one contiguous KVCache and writes it. Nothing is registered before the file
has been verified; a pool too small for the whole file takes its first blocks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np

from kvlab.cache.kv_cache import KVCache
from kvlab.cache.paged import gather_blocks, write_rows
from kvlab.errors import InputError
from kvlab.prefix.block_hash import root_key
from kvlab.sessions.persist import SavedSession, read_session_file, write_session_file


def _check_engine(engine: Any, doing: str) -> None:
    """Session files hold every layer's float rows of one block table: a quantized pool or a hybrid model's
    per-window groups have no such table."""
    if len(engine.kv_groups) > 1:
        raise InputError(f"cannot {doing} a session file on this model: its layer types keep KV-cache groups of "
                         "their own (sliding layers hold only their window)")
    if not isinstance(engine.block_pool.key_cache[0], np.ndarray):
        raise InputError(f"session files hold float K/V rows; a {engine.kv_cache_dtype} cache cannot "
                         f"{doing} them (use a float cache dtype for sessions and prompt caches)")


def _root(engine: Any) -> bytes:
    """The unsalted chain root every CLI request uses (Engine._make_request's)."""
    return root_key(engine.model.fingerprint, engine.model.dtype, engine.kv_cache_dtype)


def read_session(engine: Any, path: str | Path) -> SavedSession:
    """The verified session file at `path`, for `engine` (nothing registered yet). CheckpointError /
    CacheMismatchError for a damaged file or one from another model or cache dtype."""
    _check_engine(engine, "load")
    saved = read_session_file(path, engine.model, getattr(engine.kv_cache_dtype, "name", engine.kv_cache_dtype))
    if list(saved.cache.positions) != list(range(len(saved.tokens))):
        raise InputError(f"{path}: its rows are not at positions 0..{len(saved.tokens) - 1} (a shifted cache): "
                         "it cannot seed a prefix")
    return saved


def register_session(engine: Any, saved: SavedSession) -> int:
    """Write `saved`'s rows into pool blocks and register them in the prefix cache — whole blocks by chain
    key, the rows after them as a cached tail (PrefixCache.cache_tail) — keeping what it already holds;
    returns how many of its tokens are now cached."""
    pool, cache = engine.block_pool, engine.prefix_cache
    tokens, size, root = saved.tokens, pool.block_size, _root(engine)
    hits, keys = cache.match(tokens, root)
    if not cache.enabled:
        return 0
    whole_rows = len(tokens) // size * size
    held_tail = len(hits) * size == whole_rows and len(tokens) > whole_rows and _tail_held(
        cache, tokens, keys[-1] if keys else root, whole_rows)
    pool.acquire(hits)  # held while allocating, so eviction cannot hand out what is already matched
    try:
        if held_tail:  # every row is cached already (the tail too): nothing to write
            return len(tokens)
        wanted = max(min(-(-len(tokens) // size) - len(hits), pool.num_free_blocks), 0)
        blocks = pool.allocate(wanted)
        try:
            table = hits + blocks
            rows = np.arange(len(hits) * size, min(len(table) * size, len(tokens)))
            slot_blocks = np.asarray(table, dtype=np.int64)[rows // size]
            for layer, (k, v) in enumerate(saved.cache):
                write_rows(pool.key_cache[layer], pool.value_cache[layer], slot_blocks, rows % size,
                           k[0].transpose(1, 0, 2)[rows], v[0].transpose(1, 0, 2)[rows])  # [N, H_kv, d]
            whole = min(len(table), len(tokens) // size)
            cache.insert(table, tokens, root, whole * size, keys)
            chain = cache.match(tokens[:whole * size], root)[1]
            cached = len(chain) * size
            if len(table) > whole and len(chain) == whole and cache.cache_tail(
                    table[whole], chain[-1] if chain else root, tokens[whole * size:]):
                cached = len(tokens)
        finally:
            pool.release(blocks)  # registered ones stay cached (evictable), like a finished request's
    finally:
        pool.release(hits)
    return cached


def _tail_held(cache: Any, tokens: Sequence[int], parent: bytes, start: int) -> bool:
    """Whether the prefix cache holds rows start: of `tokens` after the chain `parent` (a cached tail or a
    full block that begins with them)."""
    held = cache.match_tail(tokens, parent, start)
    return held is not None and held[1] >= len(tokens) - start


def load_session(engine: Any, path: str | Path) -> tuple[SavedSession, int]:
    """`read_session`, then `register_session`: the file and how many of its tokens are now cached."""
    saved = read_session(engine, path)
    return saved, register_session(engine, saved)


def save_session(engine: Any, path: str | Path, token_ids: Sequence[int], extra: dict[str, Any]) -> int:
    """Write the cached K/V of the longest cached run of `token_ids` (whole blocks, then the rows of a cached
    tail) and `extra` to `path`.

    Returns the rows written (0 writes a file that restores nothing)."""
    _check_engine(engine, "save")
    pool = engine.block_pool
    tokens = [int(t) for t in token_ids]
    hits, keys = engine.prefix_cache.match(tokens, _root(engine))
    length = len(hits) * pool.block_size
    tail = engine.prefix_cache.match_tail(tokens, keys[-1] if keys else _root(engine), length)
    if tail is not None:  # the rows after the whole blocks (a finished request's partial last block)
        hits, length = hits + [tail[0]], length + min(tail[1], len(tokens) - length)
    table = np.asarray([hits], dtype=np.int64).reshape(1, len(hits))
    keys = [gather_blocks(k, table, length) for k in pool.key_cache]
    values = [gather_blocks(v, table, length) for v in pool.value_cache]
    saved = KVCache.from_arrays(engine.model.cache_spec, keys, values, np.arange(length, dtype=np.int64),
                                pool.dtype)
    write_session_file(path, saved, tokens[:length], extra)
    return length
