"""Seam 2, attention: the only code of the model that touches K/V storage.

The layer loop hands an Attention the layer's new rows of a flat batch of N tokens, after RoPE:
q [N, H_q, d], k and v [N, H_kv, d]. It writes k and v where the storage keeps them, attends each query
to the keys its sequence may see and returns the merged heads o [N, H_q d]. Everything that is the same
in every layer (the mask from absolute positions, ARCHITECTURE.md invariant 2; key ranges for the kernels; block
tables) is built once, when the Attention is made for one forward.

  * `ContiguousAttention` over a Cache (kvlab/cache/base.py, KVCache): B sequences in rows
    [B, H_kv, T, d], all at the same positions; `LlamaModel.forward` makes one per call.
  * `PagedAttention` over a PagedKV pool (BlockPool): each sequence of the batch brings its own tokens,
    positions and block table, and new rows go through the slot mapping; `LlamaModel.forward_batch`.

Each one either runs compiled kernels on the storage in place (on the compiled backend: float storage,
kvlab/kernels/attention.py for one query per sequence, kernels/prefill_attention.py for more; int8/int4/
fp8 codes with their scales for one query per sequence) or gathers the keys and values into contiguous
compute-dtype arrays and calls the NumPy reference `layers.attend` (the NumPy backend, prefills over
quantized caches, masks that are not one run of keys per query). The model knows
only the two storage protocols, never a concrete cache class.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from kvlab.cache.base import Cache, PagedKV
from kvlab.cache.paged import write_rows
from kvlab.config import ModelConfig
from kvlab.model.batch import BatchInput
from kvlab.model.layers import attend, attention_mask
from kvlab.model.paged_attention import paged_attention

_WINDOWS: dict[int, tuple[ModelConfig, list[int | None]]] = {}


def layer_windows(config: ModelConfig) -> list[int | None]:
    """Every layer's window (`config.layer_window`), worked out once per config, not once per forward: a
    ModelConfig is frozen, so the list cannot go stale. Keyed by identity (a config holds lists, so it is
    not hashable); the entry keeps its config alive, so the id cannot be reused while the entry lives."""
    entry = _WINDOWS.get(id(config))
    if entry is None or entry[0] is not config:
        if len(_WINDOWS) >= 64:  # tests build many configs: keep the few a process is using
            _WINDOWS.clear()
        entry = _WINDOWS[id(config)] = (config, [config.layer_window(i) for i in range(config.num_hidden_layers)])
    return entry[1]


class Attention(Protocol):
    """One forward's attention: `attention(layer, q, k, v) -> o [N, H_q d]` (shapes above)."""

    def __call__(self, layer: int, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray: ...


class ContiguousAttention:
    """B sequences of a Cache (or none: the new rows only), each with the same `positions` [T] this forward.

    The flat batch is row-major: token t of sequence b is row b * T + t. `compiled` asks for the kernels;
    they run only on a cache that can be read in place (`cache.in_place`: a float store). A model whose
    layers differ in window (Gemma's sliding and full layers) gets one plan per window, each layer the
    plan of its own (`ModelConfig.layer_window`); soft-capped scores (Gemma 2) take the NumPy reference,
    which the kernels do not cap. A cache whose sliding layers gave back their rows before the window
    (`cache.layer_start`, kvlab/cache/kv_cache.py) is read from there: that window's plan builds its mask
    and key ranges over the key positions from that row on. `batch_invariant` (the ops' own, int8
    activations): a prefill runs through the decode kernel too, each query row one "sequence" with its
    key range, so every row gets the bits a one-token step gives it (ARCHITECTURE.md invariant 13).
    """

    def __init__(self, cache: Cache | None, positions: np.ndarray, batch: int, config: ModelConfig,
                 compiled: bool, dtype: np.dtype, batch_invariant: bool = False) -> None:
        self.cache, self.positions, self.batch, self.dtype = cache, positions, batch, np.dtype(dtype)
        self.batch_invariant = batch_invariant
        self.num_new = len(positions)
        self._slot_rows: dict[int, np.ndarray] = {}  # `fused_step`'s, by the first new row
        key_positions = positions if cache is None else np.append(cache.positions, positions)
        self.num_keys = len(key_positions)
        self.scale, self.logit_cap = config.attention_scale, config.attn_logit_softcapping
        compiled = compiled and self.logit_cap is None
        self.in_place = compiled and (cache is None or cache.in_place)
        windows = layer_windows(config)
        # the first key row each window's layers hold (every layer of one window keeps the same rows)
        firsts = {w: 0 if cache is None else cache.layer_start(windows.index(w)) for w in dict.fromkeys(windows)}
        plans = {w: _ContiguousPlan(self, positions, key_positions[first:], config, w)
                 for w, first in firsts.items()}
        self.layer_plans = [plans[w] for w in windows]
        self.mask = self.layer_plans[0].mask  # the first layer's (every layer's, but on hybrid models)
        if cache is not None and cache.quantized and any(p.decode is None and p.rows is None for p in plans.values()):
            self.in_place = False  # codes are read in place by the decode kernel only
        if not self.in_place:
            for plan in plans.values():
                plan.ranges = plan.decode = plan.rows = None

    def _heads_first(self, x: np.ndarray) -> np.ndarray:
        """[N, H, d] rows of the flat batch as [B, H, T, d] (a view)."""
        return x.reshape(self.batch, self.num_new, *x.shape[1:]).transpose(0, 2, 1, 3)

    def merge(self, out: np.ndarray) -> np.ndarray:
        """[B, H_q, T, d] back to the flat batch's merged heads [N, H_q d]."""
        return out.transpose(0, 2, 1, 3).reshape(self.batch * self.num_new, -1)

    def gather(self, layer: int, q: np.ndarray, k: np.ndarray,
               v: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Write the new rows; return q [B, H_q, T, d] and every key and value to attend to, in the compute
        dtype ([B, H_kv, num_keys, d]: dequantized or widened copies of a low-precision cache)."""
        k, v = self._heads_first(k), self._heads_first(v)
        if self.cache is not None:
            k, v, _ = self.cache.update(layer, k, v, self.positions)
        return self._heads_first(q), k, v

    def attend(self, layer: int, q4: np.ndarray, keys: np.ndarray, values: np.ndarray) -> np.ndarray:
        """The NumPy reference over gathered rows, with the layer's mask, scale and soft-cap."""
        return self.merge(attend(q4, keys, values, self.layer_plans[layer].mask, self.scale, self.logit_cap))

    def fused_step(self, layer: int) -> tuple | None:
        """This layer's attention as a one-call block takes it (kernels/decode_block.py: k/v storage, slot
        blocks and rows, block tables, key ranges, span, threads, scale), with the cache's bookkeeping for
        the new rows done; None where the step's rows do not all go through the decode kernel (a decode
        step, or any step of batch-invariant attention) over a float cache of the compute dtype read in
        place (the layer then makes the three calls)."""
        plan = self.layer_plans[layer]
        call = plan.decode if plan.decode is not None else plan.rows  # rows: batch-invariant, any step
        if call is None or self.cache is None:
            return None
        claimed = self.cache.claim(layer, self.positions, self.dtype)
        if claimed is None:
            return None
        keys, values, row = claimed
        # row b * T + t of the flat batch goes to row `row + t` of sequence b's (one) block: the same rows
        # for every layer of a window (one array per step, not per layer)
        slot_rows = self._slot_rows.get(row)
        if slot_rows is None:
            slot_rows = self._slot_rows[row] = np.tile(np.arange(row, row + self.num_new, dtype=np.int64),
                                                       self.batch)
        return (keys, values, call.tables[:, 0], slot_rows, call.tables, call.starts, call.ends, call.span,
                call.threads, call.scale)

    def __call__(self, layer: int, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        if not self.in_place:
            return self.attend(layer, *self.gather(layer, q, k, v))
        plan = self.layer_plans[layer]
        if plan.decode is not None:  # one new row per sequence: [B, H_kv, d] -> [B, H_kv, 1, d]
            k4, v4 = k[:, :, None], v[:, :, None]
            if self.cache is not None:  # the layer's whole storage arrays; rows < num_keys are valid
                k4, v4 = self.cache.append(layer, k4, v4, self.positions)
            return plan.decode(q, k4, v4)
        k4, v4 = self._heads_first(k), self._heads_first(v)
        if self.cache is not None:
            k4, v4 = self.cache.append(layer, k4, v4, self.positions)
        if plan.rows is not None:  # batch-invariant: every query row through the decode kernel
            return plan.rows(q, k4, v4)
        q4 = self._heads_first(q)
        if plan.ranges is not None:
            return self.merge(plan.prefill.prefill_attention(q4, k4, v4, *plan.ranges, self.scale))
        end = plan.num_keys  # a mask the kernels cannot take: the NumPy reference on widened rows
        return self.attend(layer, q4, k4[:, :, :end].astype(self.dtype), v4[:, :, :end].astype(self.dtype))


class _ContiguousPlan:
    """What every layer of one window shares in a forward: its mask and, compiled, its kernel call
    (a decode step's key ranges) or each query's key range (prefill)."""

    def __init__(self, owner: ContiguousAttention, positions: np.ndarray, key_positions: np.ndarray,
                 config: ModelConfig, window: int | None) -> None:
        batch = owner.batch
        self.num_keys = num_keys = len(key_positions)  # the rows its layers hold, from their first
        self.mask = attention_mask(positions, key_positions, causal=config.causal, sliding_window=window)
        self.ranges = self.decode = self.rows = None
        if not owner.in_place:
            return
        from kvlab.kernels import attention as decode_kernels, prefill_attention

        self.prefill = prefill_attention
        if owner.num_new == 1 and self.mask is None:  # a decode step that sees every key (no window)
            starts, ends = np.zeros(batch, dtype=np.int64), np.full(batch, num_keys, dtype=np.int64)
            self.decode = _DecodeCall(decode_kernels, starts, ends, config, owner.dtype)
            return
        # each query's visible keys as one run lo..hi-1; None (some row's keys are not one run): attend
        self.ranges = prefill_attention.key_ranges(self.mask, batch, owner.num_new, num_keys)
        if self.ranges is not None and owner.num_new == 1:
            lo, hi = self.ranges
            self.decode = _DecodeCall(decode_kernels, lo[:, 0].copy(), hi[:, 0].copy(), config, owner.dtype)
        elif self.ranges is not None and owner.batch_invariant:  # row b * T + t reads sequence b's block
            lo, hi = self.ranges
            tables = np.repeat(np.arange(batch, dtype=np.int64), owner.num_new)[:, None]
            self.rows = _DecodeCall(decode_kernels, lo.ravel(), hi.ravel(), config, owner.dtype, tables)


class _DecodeCall:
    """The compiled decode kernel for one query per sequence, set up once per forward: the kernel variant
    (serial or parallel, by the number of key rows), key ranges, one-block-per-sequence tables and the
    output buffer, so that each layer is one call. The layer's storage is float rows or StoredCodes
    (int8/int4/fp8 with their scales), read in place either way."""

    def __init__(self, kernels, starts: np.ndarray, ends: np.ndarray, config: ModelConfig,
                 dtype: np.dtype, tables: np.ndarray | None = None) -> None:
        """Row b attends to its keys starts[b] .. ends[b]-1 ([B] int64 each) of the cache's sequence
        tables[b, 0] (default b: one query per sequence)."""
        batch = starts.shape[0]
        heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.starts, self.ends = starts, ends
        self.kernel = kernels.decode_kernel(int((self.ends - self.starts).sum()) * kv_heads)
        self.operands, self.span, self.threads = kernels.kernel_operands, kernels.SPAN, kernels.kernel_threads()
        # a contiguous cache: one block per sequence
        self.tables = np.arange(batch, dtype=np.int64)[:, None] if tables is None else tables
        self.scale, self.zero = dtype.type(config.attention_scale), dtype.type(0)
        self.out = np.empty((batch, heads, head_dim), dtype=dtype)  # reused: each layer's o is used at once
        self.merged = self.out.reshape(batch, heads * head_dim)

    def __call__(self, q: np.ndarray, k4: np.ndarray, v4: np.ndarray) -> np.ndarray:
        kc, ks, kz, kind, group = self.operands(k4)
        vc, vs, vz, _, _ = self.operands(v4)
        self.kernel(q * self.scale, kc, ks, kz, vc, vs, vz, kind, group, self.tables, self.starts, self.ends,
                    self.span, self.threads, self.out, self.zero)
        return self.merged


class PagedAttention:
    """A batch of sequences over a block pool: new rows written through the slot mapping, each sequence
    attending to its own blocks.

    One-token sequences (decodes) share one padded attention call; compiled on a float pool, every prefill
    chunk (each its own length and cached prefix) attends in one more call, kernels that read the blocks
    in place. Otherwise (or for a chunk whose visible keys are not one run per query) the NumPy reference
    gathers them sequence by sequence (model/paged_attention.py). What depends on the window (decode key
    starts, prefill key ranges) is one plan per distinct layer window; soft-capped scores (Gemma 2) take
    the NumPy reference. A window with a KV-cache group of its own (`batch.window_tables`: a hybrid model's
    sliding layers in the engine, kvlab/engine/kv_groups.py) brings its own block tables and slot mapping,
    and `pool` hands each layer its group's arrays, so each plan reads its layers through its own tables.
    `batch_invariant` (int8 activations): prefill chunks run through the decode kernel, one query row at a
    time, over float or quantized blocks alike (ARCHITECTURE.md invariant 13).
    """

    def __init__(self, pool: PagedKV, batch: BatchInput, config: ModelConfig, compiled: bool,
                 batch_invariant: bool = False, dtype: np.dtype | None = None) -> None:
        """`dtype`: the compute dtype; a step over a float pool of it may run in one call a layer (`fused_step`)."""
        self.batch_invariant = batch_invariant
        self.key_cache, self.value_cache = pool.key_cache, pool.value_cache
        self.causal = config.causal
        self.scale, self.logit_cap = config.attention_scale, config.attn_logit_softcapping
        compiled = compiled and self.logit_cap is None
        self.heads, self.head_dim = config.num_attention_heads, config.head_dim
        positions = self.positions = np.asarray(batch.positions, dtype=np.int64)
        self.context_lens = batch.context_lens
        self.key_starts = batch.key_starts
        query_lens = batch.query_lens
        if all(n == 1 for n in query_lens):  # a decode step: row i is sequence i (no cumsum, no lookups)
            self.starts = np.arange(len(query_lens) + 1, dtype=np.int64)
            self.decodes, self.others = list(range(len(query_lens))), []
        else:
            self.starts = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int64)
            self.decodes = [i for i, n in enumerate(query_lens) if n == 1]
            self.others = [i for i, n in enumerate(query_lens) if n > 1]
        if self.decodes:  # one padded attention call for every one-token sequence
            self.decode_rows = self.starts[:-1] if not self.others else self.starts[self.decodes]
            self.decode_positions = positions[self.decode_rows][:, None]
            self.decode_lens = np.array(batch.context_lens if not self.others else
                                        [batch.context_lens[i] for i in self.decodes], dtype=np.int64)
        # compiled attention reads a float pool in place, and the decode kernel reads quantized blocks in
        # place too (their StoredCodes); prefill chunks over quantized blocks go through the NumPy gather
        self.in_place = compiled and isinstance(self.key_cache[0], np.ndarray)
        self.decode_in_place = compiled and (self.in_place or hasattr(self.key_cache[0], "stored"))
        self.only_decodes = not self.others
        self.block_size, self.kv_heads = self.key_cache[0].shape[2], self.key_cache[0].shape[1]
        self.threads = None  # the kernels' thread count, asked once per forward for every window's plan
        if self.decode_in_place and self.decodes:
            from kvlab.kernels.attention import kernel_threads

            self.threads = kernel_threads()
        # one-call blocks (`fused_step`): a pool the kernels write and read in place (float rows of the compute
        # dtype, or codes with their compiled writer), and every row of the step through the decode kernel: a
        # decode step, or any step of batch-invariant attention (verification rows and prefill chunks with
        # int8 activations)
        first = self.key_cache[0]
        writable = (self.in_place or self.decode_in_place and getattr(first, "writer", None) is not None)
        self.fusable = writable and (self.only_decodes or batch_invariant) and dtype is not None and \
            first.dtype == dtype
        self._operands = None  # kernel_operands, for a pool of codes
        if self.fusable and not self.in_place:
            from kvlab.kernels.attention import kernel_operands

            self._operands = kernel_operands
        windows = layer_windows(config)
        plans = {w: _PagedPlan(self, batch, w) for w in dict.fromkeys(windows)}
        self.layer_plans = [plans[w] for w in windows]

    def fused_step(self, layer: int) -> tuple | None:
        """This layer's attention as a one-call block takes it (ContiguousAttention.fused_step says what);
        None unless every row of the step goes through the decode kernel (only decodes, or batch-invariant
        attention with every prefill chunk's keys one run per query) over a pool the kernels write in place:
        float rows of the compute dtype, or int8 / int4 / fp8 codes (kernels/attention.py's
        `write_codes_and_attend` operands then)."""
        plan = self.layer_plans[layer]
        if plan.fused is None:
            return None
        if self._operands is None:
            return (self.key_cache[layer], self.value_cache[layer], *plan.fused)
        kc, ks, kz, kind, group = self._operands(self.key_cache[layer].stored())
        vc, vs, vz, _, _ = self._operands(self.value_cache[layer].stored())
        return (kc, ks, kz, vc, vs, vz, kind, group, *plan.fused)

    def __call__(self, layer: int, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        key_cache, value_cache = self.key_cache[layer], self.value_cache[layer]
        plan = self.layer_plans[layer]
        if plan.lone_slot is not None:  # one new row into a float pool: write_rows' lone-decode branch
            block, row = plan.lone_slot
            key_cache[block, :, row] = k[0]
            value_cache[block, :, row] = v[0]
        else:
            write_rows(key_cache, value_cache, plan.slot_blocks, plan.slot_rows, k, v)
        if plan.decode_call is not None and self.only_decodes:  # a decode step: no rows to scatter
            out = plan.decode_call(q, _stored(key_cache), _stored(value_cache), self.scale)
            return out.reshape(q.shape[0], self.heads * self.head_dim)
        attn = np.empty((q.shape[0], self.heads, self.head_dim), dtype=q.dtype)
        if plan.decode_call is not None:
            attn[self.decode_rows] = plan.decode_call(q[self.decode_rows], _stored(key_cache),
                                                      _stored(value_cache), self.scale)
        elif self.decodes:
            out = paged_attention(q[self.decode_rows][:, :, None], key_cache, value_cache, plan.decode_tables,
                                  self.decode_positions, self.decode_lens, causal=self.causal,
                                  sliding_window=plan.window, key_starts=plan.decode_starts, scale=self.scale,
                                  logit_cap=self.logit_cap)
            attn[self.decode_rows] = out[:, :, 0]
        if plan.prefill is not None:
            attn[plan.prefill.rows] = plan.prefill(q, key_cache, value_cache, self.scale)
        for i in self.others:
            if plan.ranges.get(i) is not None:
                continue
            rows = slice(self.starts[i], self.starts[i + 1])
            out = paged_attention(q[rows].transpose(1, 0, 2)[None], key_cache, value_cache, plan.seq_tables[i],
                                  self.positions[rows][None], [self.context_lens[i]], causal=self.causal,
                                  sliding_window=plan.window,
                                  key_starts=None if self.key_starts is None else [self.key_starts[i]],
                                  scale=self.scale, logit_cap=self.logit_cap)
            attn[rows] = out[0].transpose(1, 0, 2)
        return attn.reshape(q.shape[0], self.heads * self.head_dim)


class _PagedPlan:
    """What the layers of one window share in a paged forward: their block tables and slot mapping (their
    KV-cache group's), each decode's first visible key, each compiled prefill chunk's key ranges and the one
    kernel call over them."""

    def __init__(self, owner: PagedAttention, batch: BatchInput, window: int | None) -> None:
        self.window = window
        tables, self.slot_mapping = (batch.window_tables or {}).get(window, (batch.block_tables,
                                                                            batch.slot_mapping))
        block_size = owner.block_size
        self.slot_blocks, self.slot_rows = np.divmod(np.asarray(self.slot_mapping, dtype=np.int64), block_size)
        # a lone decode over float blocks: its slot as two ints, split once for every layer
        self.lone_slot = (int(self.slot_blocks[0]), int(self.slot_rows[0])) \
            if len(self.slot_blocks) == 1 and isinstance(owner.key_cache[0], np.ndarray) else None
        self.decode_tables = None
        if owner.decodes:
            self.decode_tables = _padded(tables if owner.only_decodes else [tables[i] for i in owner.decodes])
        self.decode_call = None  # compiled decodes: one kernel call a layer, its tables and ranges set up here
        self.seq_tables = {i: np.array([tables[i]], dtype=np.int64) for i in owner.others}
        self.decode_starts = None
        self.ranges: dict = {}  # compiled prefill: each chunk's visible keys as one range per query
        self.prefill = None  # compiled prefill: one call over every chunk with ranges (_PrefillCall)
        if owner.decodes:
            # a decode sees keys from its window's start (W keys, itself included) to itself
            self.decode_starts = np.maximum(owner.decode_positions[:, 0] - window + 1, 0) if window else None
            if batch.key_starts is not None:  # a cache policy's view start (kvlab/engine/kv_bounds.py)
                view = np.array([batch.key_starts[i] for i in owner.decodes], dtype=np.int64)
                self.decode_starts = view if self.decode_starts is None else np.maximum(self.decode_starts, view)
            if owner.decode_in_place:
                from kvlab.kernels.attention import PagedDecodeCall

                self.decode_call = PagedDecodeCall(self.decode_tables, owner.decode_lens, self.decode_starts,
                                                   block_size, owner.kv_heads, owner.threads)
        self.fused = None  # a one-call block's operands but the layer's storage (PagedAttention.fused_step)
        if owner.fusable and owner.only_decodes and self.decode_call is not None:
            self._fuse(owner, self.decode_call)
        if not owner.others or not (owner.in_place or owner.batch_invariant and owner.decode_in_place):
            return  # a decode step has no prefill chunk to plan
        from kvlab.kernels import prefill_attention

        for i in owner.others:
            query_positions = owner.positions[owner.starts[i]:owner.starts[i + 1]]
            mask = attention_mask(query_positions, np.arange(batch.context_lens[i]), causal=owner.causal,
                                  sliding_window=window)
            self.ranges[i] = prefill_attention.key_ranges(mask, 1, len(query_positions), batch.context_lens[i])
            if self.ranges[i] is not None and batch.key_starts is not None:
                lo, hi = self.ranges[i]
                self.ranges[i] = (np.maximum(lo, batch.key_starts[i]), hi)
        ranged = [i for i in owner.others if self.ranges[i] is not None]
        if ranged and owner.batch_invariant:
            self.prefill = _RowsCall(ranged, owner.starts, self.ranges, tables, block_size, owner.kv_heads)
            if owner.fusable and len(ranged) == len(owner.others):  # every row a one-query "sequence"
                self._fuse(owner, self._every_row(owner, tables))
        elif ranged:
            self.prefill = _PrefillCall(prefill_attention, ranged, owner.starts, self.ranges,
                                        [tables[i] for i in ranged])

    def _fuse(self, owner: "PagedAttention", call: object) -> None:
        """The operands of a one-call block whose attention is `call` (a PagedDecodeCall over every row of
        the step, in the flat batch's order), its new rows written through this plan's slot mapping."""
        from kvlab.kernels.attention import SPAN, typed_scale

        scale = typed_scale(owner.scale, owner.head_dim, owner.key_cache[0].dtype)
        self.fused = (self.slot_blocks, self.slot_rows, call.tables, call.starts, call.ends, SPAN, call.threads, scale)

    def _every_row(self, owner: "PagedAttention", tables: list[list[int]]) -> object:
        """One decode-kernel call over every row of the flat batch: a decode row with its sequence's key
        range (its window's or policy's start), a prefill chunk's row with its own (`ranges`); the rows
        `decode_call` and `prefill` take apart, with the same tables and ranges, so the same bits."""
        from kvlab.kernels.attention import PagedDecodeCall

        rows = len(owner.positions)
        lo, hi = np.zeros(rows, dtype=np.int64), np.zeros(rows, dtype=np.int64)
        seq = np.repeat(np.arange(len(owner.starts) - 1), np.diff(owner.starts))
        for j, i in enumerate(owner.decodes):
            row = owner.starts[i]
            lo[row] = 0 if self.decode_starts is None else self.decode_starts[j]
            hi[row] = owner.context_lens[i]
        for i in owner.others:
            (first,), (last,) = self.ranges[i]
            lo[owner.starts[i]:owner.starts[i + 1]], hi[owner.starts[i]:owner.starts[i + 1]] = first, last
        return PagedDecodeCall(_padded(tables)[seq], hi, lo, owner.block_size, owner.kv_heads, owner.threads)


def _stored(blocks: object) -> object:
    """A pool layer as the decode kernel reads it: a float array as it is, quantized blocks' StoredCodes."""
    return blocks if isinstance(blocks, np.ndarray) else blocks.stored()


class _PrefillCall:
    """Every compiled prefill chunk of a paged batch in one kernel call, set up once per forward: the
    chunks' rows of the flat batch, where each chunk starts among them, their key ranges and block tables."""

    def __init__(self, kernels, seqs: list[int], starts: np.ndarray, ranges: dict, tables: list[list[int]]) -> None:
        """seqs: the chunks' sequences in the batch; starts [S + 1]: the batch's row offsets; ranges[i]: the
        (lo, hi) [1, n] of sequence i's chunk (prefill_attention.key_ranges)."""
        self.kernels = kernels
        self.rows, self.lo, self.hi = _chunk_rows(seqs, starts, ranges)
        lens = [starts[i + 1] - starts[i] for i in seqs]
        self.query_starts = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        self.tables = _padded(tables)

    def __call__(self, q: np.ndarray, key_cache: np.ndarray, value_cache: np.ndarray,
                 scale: float | None = None) -> np.ndarray:
        """The chunks' attention [rows, H_q, d] for one layer's q [N, H_q, d] (new K/V written already)."""
        return self.kernels.varlen_prefill_attention(q[self.rows], key_cache, value_cache, self.tables,
                                                     self.query_starts, self.lo, self.hi, scale)


class _RowsCall:
    """Batch-invariant prefill: every row of the compiled prefill chunks as a one-query "sequence" of the
    decode kernel (its chunk's block table, its key range), so each row gets a decode step's bits."""

    def __init__(self, seqs: list[int], starts: np.ndarray, ranges: dict, tables: list[list[int]],
                 block_size: int, kv_heads: int) -> None:
        from kvlab.kernels.attention import PagedDecodeCall

        self.rows, lo, hi = _chunk_rows(seqs, starts, ranges)
        row_tables = _padded([tables[i] for i in seqs for _ in range(starts[i + 1] - starts[i])])
        self.call = PagedDecodeCall(row_tables, hi, lo, block_size, kv_heads)

    def __call__(self, q: np.ndarray, key_cache: object, value_cache: object,
                 scale: float | None = None) -> np.ndarray:
        return self.call(q[self.rows], _stored(key_cache), _stored(value_cache), scale)


def _chunk_rows(seqs: list[int], starts: np.ndarray, ranges: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The prefill chunks' rows of the flat batch and each row's key range lo..hi-1, chunk after chunk."""
    rows = np.concatenate([np.arange(starts[i], starts[i + 1]) for i in seqs])
    lo = np.concatenate([ranges[i][0][0] for i in seqs])
    hi = np.concatenate([ranges[i][1][0] for i in seqs])
    return rows, lo, hi


def _padded(tables: list[list[int]]) -> np.ndarray:
    """Block tables as one [S, longest] int64 array, shorter rows padded with block 0 (never read)."""
    width = max(len(t) for t in tables)
    if all(len(t) == width for t in tables):  # one table (batch 1), or tables alike: no padding to do
        return np.array(tables, dtype=np.int64).reshape(len(tables), width)
    out = np.zeros((len(tables), width), dtype=np.int64)
    for row, table in enumerate(tables):
        out[row, :len(table)] = table
    return out
