"""Attention over K/V held in a block pool, and writing new K/V through a slot mapping: the NumPy reference.

The pool stores each layer as [num_blocks, H_kv, block_size, d]; a sequence's token at position p sits in
block `block_table[p // block_size]`, row `p % block_size`. Here the visible blocks are gathered into a
contiguous [B, H_kv, T, d] copy and handed to the same `attend` the model uses everywhere, with a mask
built from absolute positions (ARCHITECTURE.md invariant 2). A compiled twin may read the blocks in place; it must
equal this function.
"""

from __future__ import annotations

import numpy as np

from kvlab.cache.paged import gather_blocks
from kvlab.model.layers import attend, attention_mask


def paged_attention(q: np.ndarray, key_cache: np.ndarray, value_cache: np.ndarray, block_tables: np.ndarray,
                    query_positions: np.ndarray, context_lens: np.ndarray, *, causal: bool = True,
                    sliding_window: int | None = None, key_starts: np.ndarray | None = None,
                    scale: float | None = None, logit_cap: float | None = None) -> np.ndarray:
    """Attention of B sequences' new queries against their own cached K/V (new rows already written).

    q: [B, H_q, n, d] after RoPE; key_cache/value_cache: one layer of the pool; block_tables: [B, M] block
    ids (rows padded with any valid id); query_positions: [B, n] absolute positions (-1 marks a padding
    query, which gets zeros); context_lens: [B], row b sees its keys at positions 0..context_lens[b]-1.
    Returns [B, H_q, n, d].
    """
    context_lens = np.asarray(context_lens, dtype=np.int64)
    length = int(context_lens.max())
    keys = gather_blocks(key_cache, block_tables, length)
    values = gather_blocks(value_cache, block_tables, length)
    if keys.dtype != q.dtype:  # a low-precision cache: attend in the compute dtype
        keys, values = keys.astype(q.dtype), values.astype(q.dtype)
    key_positions = np.arange(length)
    mask = attention_mask(query_positions, key_positions, causal=causal, sliding_window=sliding_window)
    if key_starts is not None:
        after = (key_positions[None, :] >= np.asarray(key_starts, dtype=np.int64)[:, None])[:, None, :]
        mask = np.broadcast_to(after, (q.shape[0], q.shape[2], length)) if mask is None else mask & after
    if (context_lens < length).any() or (query_positions < 0).any():
        in_context = (key_positions[None, :] < context_lens[:, None])[:, None, :]  # [B, 1, T]
        in_context = in_context & (query_positions >= 0)[:, :, None]
        mask = in_context if mask is None else mask & in_context
    return attend(q, keys, values, mask, scale, logit_cap)
