"""The model runner: one scheduled step as one flat batch, through the model, back as logits.

As nano-vllm's ModelRunner: it turns the scheduler's (sequence, tokens this step) pairs into the batch the
model reads (token ids, absolute positions, per-sequence query and context lengths, block tables, the slot
mapping new K/V rows are written through, and which rows' logits to return), writes a cache policy's
re-rotated sink rows (`write_sinks`), runs the forward over the pool's K/V, and only then advances each
sequence's num_computed_tokens and registers its newly full blocks in the prefix cache: a block is
findable only once every layer has written it. A scoring request's rows (Engine.score) all get logits,
kept on its request beside the sampled rows. On a hybrid model each KV-cache group
(kvlab/engine/kv_groups.py) brings its own block tables and slot mapping, and the model reads each layer's
K/V from its group's pool (GroupedKV).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from kvlab.cache.paged import BlockPool, gather_blocks, slot_mapping, write_slots
from kvlab.engine.counters import StepCounters
from kvlab.engine.kv_bounds import NULL_BLOCK, KVBounds, held_rows
from kvlab.engine.kv_groups import CacheGroup, GroupedKV
from kvlab.engine.request import Sequence
from kvlab.model.batch import BatchInput
from kvlab.model.llama import LlamaModel
from kvlab.policies.shift import rotate_keys
from kvlab.prefix.prefix_cache import PrefixCache


class ModelRunner:
    """Batch preparation, the forward over the pool, and the commit of what it computed."""

    def __init__(self, model: LlamaModel, pool: BlockPool, prefix_cache: PrefixCache,
                 counters: StepCounters, bounds: KVBounds | None = None,
                 groups: list[CacheGroup] | None = None) -> None:
        """`groups`: every KV-cache group, group 0 being (pool, prefix_cache, bounds); None: that one alone."""
        self.model = model
        self.pool = pool
        self.prefix_cache = prefix_cache
        self.counters = counters
        self.bounds = bounds if bounds is not None else KVBounds(pool, prefix_cache)
        self.groups = groups if groups is not None else [
            CacheGroup(0, self.bounds.sliding_window, (), pool, prefix_cache, self.bounds)]
        # what the model reads K/V from: the one pool, or each layer's group's pool
        self.kv = pool if len(self.groups) == 1 else GroupedKV(self.groups, model.config.num_hidden_layers)

    def prepare(self, scheduled: list[tuple[Sequence, int]]) -> tuple[BatchInput, list[Sequence]]:
        """The flat batch of one step, and the sequences whose last scheduled token ends their known tokens
        (they get logits, in batch order: one row each, or 1 + len(draft) rows for a speculating sequence,
        its last token's and each guess's)."""
        if all(num_new == 1 and not seq.draft for seq, num_new in scheduled):
            return self._prepare_decodes([seq for seq, _ in scheduled])
        return self._prepare_chunks(scheduled)

    def _prepare_chunks(self, scheduled: list[tuple[Sequence, int]]) -> tuple[BatchInput, list[Sequence]]:
        """`prepare` of any step: prefill chunks, decodes and guesses alike."""
        size = self.pool.block_size
        ids, positions, logits_rows, sampled = [], [], [], []
        slots: list[list[np.ndarray]] = [[] for _ in self.groups]
        row = 0
        for seq, num_new in scheduled:
            start = seq.num_computed_tokens
            ids.append(seq.token_ids[start:start + num_new - len(seq.draft)] + seq.draft)
            positions.append(np.arange(start, start + num_new))
            for group in self.groups:
                slots[group.index].append(slot_mapping(group.table(seq), start, num_new, size))
            row += num_new
            if start + num_new - len(seq.draft) == seq.num_tokens:
                logits_rows.extend(range(row - 1 - len(seq.draft), row))
                sampled.append(seq)
            self.counters.num_computed_tokens += num_new
            if not (num_new == 1 and seq.num_tokens > seq.request.num_prompt_tokens):
                self.counters.num_prefill_tokens += num_new
        # A speculating sequence's rows enter as one-token queries of their own (same blocks, each seeing the
        # keys up to its position), so each row attends exactly as a decode step would: verification rows get
        # a one-token step's logits, bit for bit where the products are row-independent (kernels/gemv.py)
        entries = [(s, 1, s.num_computed_tokens + i + 1) if s.draft else (s, n, s.num_computed_tokens + n)
                   for s, n in scheduled for i in (range(n) if s.draft else (0,))]
        batch = BatchInput(
            token_ids=np.concatenate([np.asarray(i, dtype=np.int64) for i in ids]),
            positions=np.concatenate(positions), query_lens=[n for _, n, _ in entries],
            context_lens=[end for _, _, end in entries],
            block_tables=[_readable(s.block_table) for s, _, _ in entries], slot_mapping=np.concatenate(slots[0]),
            logits_indices=np.array(logits_rows, dtype=np.int64),
            key_starts=[self.bounds.key_start(s) for s, _, _ in entries] if self.bounds.policy else None,
            window_tables={g.window: ([_readable(g.table(s)) for s, _, _ in entries],
                                      np.concatenate(slots[g.index])) for g in self.groups[1:]} or None)
        return batch, sampled

    def _prepare_decodes(self, seqs: list[Sequence]) -> tuple[BatchInput, list[Sequence]]:
        """`prepare` of a step in which every sequence computes one token and guesses none (a decode step,
        or a one-token chunk): the same batch, each array made once from plain ints."""
        size = self.pool.block_size
        starts = [seq.num_computed_tokens for seq in seqs]
        rows = [row for row, (seq, start) in enumerate(zip(seqs, starts)) if start + 1 == seq.num_tokens]
        self.counters.num_computed_tokens += len(seqs)
        self.counters.num_prefill_tokens += sum(1 for seq in seqs if seq.num_tokens <= seq.request.num_prompt_tokens)
        slots = [[table[start // size] * size + start % size for table, start in zip(tables, starts)]
                 for tables in ([group.table(seq) for seq in seqs] for group in self.groups)]
        batch = BatchInput(
            token_ids=np.array([seq.token_ids[start] for seq, start in zip(seqs, starts)], dtype=np.int64),
            positions=np.array(starts, dtype=np.int64), query_lens=[1] * len(seqs),
            context_lens=[start + 1 for start in starts], block_tables=[_readable(s.block_table) for s in seqs],
            slot_mapping=np.array(slots[0], dtype=np.int64), logits_indices=np.array(rows, dtype=np.int64),
            key_starts=[self.bounds.key_start(s) for s in seqs] if self.bounds.policy else None,
            window_tables={g.window: ([_readable(g.table(s)) for s in seqs], np.array(slots[g.index], dtype=np.int64))
                           for g in self.groups[1:]} or None)
        return batch, [seqs[row] for row in rows]

    def run(self, scheduled: list[tuple[Sequence, int]]) -> tuple[np.ndarray, list[Sequence]]:
        """One batched forward over every scheduled token; logits [len(sampled), vocab] and `sampled`."""
        batch, sampled = self.prepare(scheduled)
        scoring = _scoring_rows(scheduled)
        if scoring:  # a scoring request's every row: after the sampled rows, split off below
            extra = [np.arange(row, row + num_new) for row, _, _, num_new in scoring]
            batch = replace(batch, logits_indices=np.concatenate([batch.logits_indices, *extra]))
        for seq, _ in scheduled:
            self.write_sinks(seq)
        logits = self.model.forward_batch(batch, self.kv)
        for seq, num_new in scheduled:  # every layer has written: commit, then make full blocks findable
            if not seq.draft:  # a speculating sequence commits what verification keeps (commit_accepted)
                self.commit(seq, num_new)
        if scoring:
            split = len(logits) - sum(num_new for *_, num_new in scoring)
            self._keep_scores(scoring, logits[split:])
            logits = logits[:split]
        return logits, sampled

    def _keep_scores(self, scoring: list[tuple[int, Sequence, int, int]], rows: np.ndarray) -> None:
        """Record each scoring sequence's prompt rows' logits by position (a recomputed row replaces its
        first copy), and the rows its cache holds after the step."""
        at = 0
        for _, seq, start, num_new in scoring:
            score = seq.request.score
            for offset in range(min(num_new, seq.request.num_prompt_tokens - start)):
                position, row = start + offset, rows[at + offset]
                if position < len(score.logits):
                    score.logits[position] = row
                else:
                    score.logits.append(row)
            score.rows = held_rows(seq)
            score.peak_rows = max(score.peak_rows, score.rows)
            at += num_new

    def write_sinks(self, seq: Sequence) -> None:
        """A policy's prefix rows, re-rotated by view_start from the originals (its sink source), written at
        positions view_start..window_start-1 into the private blocks the scheduler gave them
        (KVBounds.place_sinks); nothing without an eviction. Only `prefix` rows per layer are rotated."""
        view = self.bounds.sink_view(seq)
        if view is None:
            return
        source = np.asarray([view.sink_source], dtype=np.int64)
        slots = slot_mapping(seq.block_table, view.view_start, view.prefix, self.pool.block_size)
        rows = np.arange(view.prefix)
        angles = self.model.rope_tables.angles(rows + view.view_start) - self.model.rope_tables.angles(rows)
        for rope, keys, values in zip(self.model.layer_rope, self.pool.key_cache, self.pool.value_cache):
            k = gather_blocks(keys, source, view.prefix)
            if rope != "none":  # SmolLM3's NoPE layers: keys carry no position, moved as they are
                k = rotate_keys(k, angles)
            v = gather_blocks(values, source, view.prefix)
            write_slots(keys, values, slots, k[0].transpose(1, 0, 2), v[0].transpose(1, 0, 2))

    def commit(self, seq: Sequence, num_rows: int) -> None:
        """`num_rows` more of `seq`'s tokens have K/V in the pool: count them, register its full blocks."""
        seq.num_computed_tokens += num_rows
        if not self.bounds.registers(seq):
            return
        known = len(seq.block_keys)
        inserted = self.prefix_cache.insert(seq.block_table, seq.token_ids, seq.request.root_key,
                                            seq.num_computed_tokens, seq.block_keys)
        if inserted.keys:
            seq.block_keys.extend(inserted.keys)
            for group in self.groups[1:]:  # group 0's chain keys: one hit finds every group's blocks
                group.prefix_cache.insert_keys(group.table(seq), seq.token_ids, seq.request.root_key,
                                               seq.block_keys, known)

    def commit_accepted(self, seq: Sequence, num_rows: int) -> None:
        """After verification: keep the last token's row and the accepted guesses' (`num_rows`), forget the
        rejected guesses, and give back the table's blocks that held only rejected rows."""
        seq.draft = []
        self.commit(seq, num_rows)
        keep = self.pool.blocks_for(seq.num_tokens)
        for group in self.groups:
            table = group.table(seq)
            if len(table) > keep:
                group.pool.release([b for b in table[keep:] if b != NULL_BLOCK])
                del table[keep:]


def _scoring_rows(scheduled: list[tuple[Sequence, int]]) -> list[tuple[int, Sequence, int, int]]:
    """(first row in the flat batch, sequence, first position, rows) of each scheduled sequence whose request
    is scoring its prompt (Engine.score); rows are laid out in schedule order."""
    if all(seq.request.score is None for seq, _ in scheduled):
        return []
    found, row = [], 0
    for seq, num_new in scheduled:
        if seq.request.score is not None:
            found.append((row, seq, seq.num_computed_tokens, num_new))
        row += num_new
    return found


def _readable(table: list[int]) -> list[int]:
    """A block table the attention can index: released entries (never read: before the key start or the
    window) read as block 0."""
    return [0 if b == NULL_BLOCK else b for b in table] if NULL_BLOCK in table else table
