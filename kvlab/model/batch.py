"""One forward over many sequences at once: the batched step of the paged engine.

All scheduled tokens of all sequences are flattened into one [N] batch (ragged: each sequence brings its
own number of tokens, at its own positions, which start at its num_computed_tokens). Embedding, the q/k/v
projection, RoPE, the output projection and the MLP run over the whole flat batch as single matmuls; only
attention is per sequence, against the sequence's own blocks. One-token sequences (decodes) share one
padded attention call (on the compiled backend, a kernel that reads the blocks in place; NumPy gathers them);
prefill chunks attend sequence by sequence (compiled: kvlab/kernels/prefill_attention.py, in place too).
New K/V are written into the pool through the slot mapping before attention reads.
The math is the model's own (`embed_tokens`, `_qkv`, `_finish_block`, `final_logits`, its RoPE tables,
`attend`), not a copy of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvlab.cache.paged import write_slots
from kvlab.model.layers import attention_mask, rotate_halves
from kvlab.model.llama import LlamaModel
from kvlab.model.paged_attention import paged_attention


@dataclass
class BatchInput:
    """What the scheduler hands the model for one step (lengths are plain ints)."""

    token_ids: np.ndarray          # [N] every scheduled token, sequence after sequence
    positions: np.ndarray          # [N] each token's absolute position
    query_lens: list[int]          # tokens per sequence (sum = N)
    context_lens: list[int]        # per sequence: positions visible after this step (num_computed + query_len)
    block_tables: list[list[int]]  # per sequence
    slot_mapping: np.ndarray       # [N] where each new K/V row is written
    logits_indices: np.ndarray     # rows of the flat batch whose logits are returned


def _padded(tables: list[list[int]]) -> np.ndarray:
    width = max(len(t) for t in tables)
    out = np.zeros((len(tables), width), dtype=np.int64)
    for row, table in enumerate(tables):
        out[row, :len(table)] = table
    return out


def forward_batch(model: LlamaModel, batch: BatchInput, key_cache: list[np.ndarray],
                  value_cache: list[np.ndarray]) -> np.ndarray:
    """Run one step; write the new K/V into the per-layer pools; return logits [len(logits_indices), vocab]."""
    config = model.config
    heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    qk_heads = heads + kv_heads
    num_tokens = len(batch.token_ids)
    positions = np.asarray(batch.positions, dtype=np.int64)
    cos, sin = model._rope_tables(int(positions.max()) + 1)
    cos, sin = cos[positions][:, None], sin[positions][:, None]  # [N, 1, d]

    starts = np.concatenate([[0], np.cumsum(batch.query_lens)]).astype(np.int64)
    decodes = [i for i, n in enumerate(batch.query_lens) if n == 1]
    others = [i for i, n in enumerate(batch.query_lens) if n > 1]
    if decodes:  # one padded attention call for every one-token sequence
        decode_rows = starts[decodes]
        decode_tables = _padded([batch.block_tables[i] for i in decodes])
        decode_positions = positions[decode_rows][:, None]
        decode_lens = np.array([batch.context_lens[i] for i in decodes], dtype=np.int64)
        # a decode sees keys from its window's start (W keys, itself included) to itself
        window = config.sliding_window
        decode_starts = np.maximum(decode_positions[:, 0] - window + 1, 0) if window else None
    # compiled decode attention reads a float pool in place; quantized blocks go through the NumPy gather
    in_place = model.backend == "numba" and isinstance(key_cache[0], np.ndarray)
    seq_tables = {i: np.array([batch.block_tables[i]], dtype=np.int64) for i in others}
    # compiled prefill attention: each chunk's visible keys as one range per query (None: the NumPy path)
    ranges = {}
    if in_place:
        for i in others:
            query_positions = positions[starts[i]:starts[i + 1]]
            mask = attention_mask(query_positions, np.arange(batch.context_lens[i]), causal=config.causal,
                                  sliding_window=config.sliding_window)
            ranges[i] = model._prefill.key_ranges(mask, 1, len(query_positions), batch.context_lens[i])

    x = model.embed_tokens(np.asarray(batch.token_ids, dtype=np.int64))  # [N, hidden], the residual stream
    with np.errstate(over="ignore"):  # swiglu's exp(-gate) may overflow to inf: correct, and silent
        for index, layer in enumerate(model.layers):
            qkv = model._qkv(x, layer).reshape(num_tokens, qk_heads + kv_heads, head_dim)
            qk = rotate_halves(qkv[:, :qk_heads], cos, sin)  # [N, H_q + H_kv, d]
            q = qk[:, :heads]
            write_slots(key_cache[index], value_cache[index], batch.slot_mapping, qk[:, heads:],
                        qkv[:, qk_heads:])
            attn = np.empty((num_tokens, heads, head_dim), dtype=x.dtype)
            if decodes and in_place:  # the compiled twin reads the blocks where they lie
                attn[decode_rows] = model._attention.paged_decode_attention(
                    q[decode_rows], key_cache[index], value_cache[index], decode_tables, decode_lens,
                    decode_starts)
            elif decodes:
                out = paged_attention(q[decode_rows][:, :, None], key_cache[index], value_cache[index],
                                      decode_tables, decode_positions, decode_lens, causal=config.causal,
                                      sliding_window=config.sliding_window)
                attn[decode_rows] = out[:, :, 0]
            for i in others:
                rows = slice(starts[i], starts[i + 1])
                if ranges.get(i) is not None:
                    attn[rows] = model._prefill.paged_prefill_attention(
                        q[rows].transpose(1, 0, 2)[None], key_cache[index], value_cache[index], seq_tables[i],
                        *ranges[i])[0].transpose(1, 0, 2)
                    continue
                out = paged_attention(q[rows].transpose(1, 0, 2)[None], key_cache[index], value_cache[index],
                                      seq_tables[i], positions[rows][None], [batch.context_lens[i]],
                                      causal=config.causal, sliding_window=config.sliding_window)
                attn[rows] = out[0].transpose(1, 0, 2)
            model._finish_block(x, layer, attn.reshape(num_tokens, heads * head_dim))
    return model.final_logits(x[np.asarray(batch.logits_indices, dtype=np.int64)])
