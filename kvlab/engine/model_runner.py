"""The model runner: one scheduled step as one flat batch, through the model, back as logits.

As nano-vllm's ModelRunner: it turns the scheduler's (sequence, tokens this step) pairs into the batch the
model reads (token ids, absolute positions, per-sequence query and context lengths, block tables, the slot
mapping new K/V rows are written through, and which rows' logits to return), runs the forward over the
pool's K/V, and only then advances each sequence's num_computed_tokens and registers its newly full blocks
in the prefix cache: a block is findable only once every layer has written it.
"""

from __future__ import annotations

import numpy as np

from kvlab.cache.paged import BlockPool, slot_mapping
from kvlab.engine.introspection import StepCounters
from kvlab.engine.kv_bounds import NULL_BLOCK, KVBounds
from kvlab.engine.request import Sequence
from kvlab.model.batch import BatchInput
from kvlab.model.llama import LlamaModel
from kvlab.prefix.prefix_cache import PrefixCache


class ModelRunner:
    """Batch preparation, the forward over the pool, and the commit of what it computed."""

    def __init__(self, model: LlamaModel, pool: BlockPool, prefix_cache: PrefixCache,
                 counters: StepCounters, bounds: KVBounds | None = None) -> None:
        self.model = model
        self.pool = pool
        self.prefix_cache = prefix_cache
        self.counters = counters
        self.bounds = bounds if bounds is not None else KVBounds(pool, prefix_cache, inv_freq=None)

    def prepare(self, scheduled: list[tuple[Sequence, int]]) -> tuple[BatchInput, list[Sequence]]:
        """The flat batch of one step, and the sequences whose last scheduled token ends their known tokens
        (they get logits, in batch order)."""
        size = self.pool.block_size
        ids, positions, slots, logits_rows, sampled = [], [], [], [], []
        row = 0
        for seq, num_new in scheduled:
            start = seq.num_computed_tokens
            ids.append(seq.token_ids[start:start + num_new])
            positions.append(np.arange(start, start + num_new))
            slots.append(slot_mapping(seq.block_table, start, num_new, size))
            row += num_new
            if start + num_new == seq.num_tokens:
                logits_rows.append(row - 1)
                sampled.append(seq)
            self.counters.num_computed_tokens += num_new
            if not (num_new == 1 and seq.num_tokens > seq.request.num_prompt_tokens):
                self.counters.num_prefill_tokens += num_new
        batch = BatchInput(
            token_ids=np.concatenate([np.asarray(i, dtype=np.int64) for i in ids]),
            positions=np.concatenate(positions), query_lens=[n for _, n in scheduled],
            context_lens=[s.num_computed_tokens + n for s, n in scheduled],
            block_tables=[_readable(s.block_table) for s, _ in scheduled], slot_mapping=np.concatenate(slots),
            logits_indices=np.array(logits_rows, dtype=np.int64),
            key_starts=[self.bounds.key_start(s) for s, _ in scheduled] if self.bounds.policy else None)
        return batch, sampled

    def run(self, scheduled: list[tuple[Sequence, int]]) -> tuple[np.ndarray, list[Sequence]]:
        """One batched forward over every scheduled token; logits [len(sampled), vocab] and `sampled`."""
        batch, sampled = self.prepare(scheduled)
        logits = self.model.forward_batch(batch, self.pool)
        for seq, num_new in scheduled:  # every layer has written: commit, then make full blocks findable
            seq.num_computed_tokens += num_new
            if not self.bounds.registers(seq):
                continue
            inserted = self.prefix_cache.insert(seq.block_table, seq.token_ids, seq.request.root_key,
                                                seq.num_computed_tokens, seq.block_keys)
            if inserted.keys:
                seq.block_keys.extend(inserted.keys)
        return logits, sampled


def _readable(table: list[int]) -> list[int]:
    """A block table the attention can index: released entries (never read: before the key start or the
    window) read as block 0."""
    return [0 if b == NULL_BLOCK else b for b in table] if NULL_BLOCK in table else table
