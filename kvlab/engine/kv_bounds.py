"""Bounded K/V per sequence in the paged engine: sliding-window models and cache policies (window, sinks,
context shift) give back the blocks no future query can see, so a long conversation holds a bounded
number of blocks.

Sliding-window models (config.sliding_window = W): a query at position p sees keys p-W+1..p, and later
queries see later keys, so a block whose last position is before num_computed_tokens - W + 1 is never
read again. It is released (vLLM's SlidingWindowManager swaps it for its null block; here the table entry
becomes NULL_BLOCK, read as block 0 and masked out). Its K/V are the model's own, so a registered block
stays in the prefix cache as it was.

Cache policies (`kv_policy`, kvlab/policies): the engine must give the same logits as the policy done by
hand on the contiguous reference cache with the same chunks (PolicyCache, kvlab/verify/policy_reference.py;
`kvlab verify`'s "policy" schedule). There, before a chunk of n tokens the policy keeps rows `keep(L, n)` of
the L cached rows and moves them to positions 0..k-1 (re-rotating keys). Every policy
run here keeps a text prefix [0, s) (sinks, context shift's n_keep) plus a text tail [ws, chunk start):
  * the tail stays where it is, at its text positions, and the queries use text positions too: RoPE
    scores depend only on query-key distances, which are the same as in the contiguous cache (there the
    tail and the query both moved down by the same ws - s);
  * the prefix must sit right before the tail (contiguous: sink j at j, tail row at s + i). Its keys are
    re-rotated from the originals (text rows 0..s-1, whose blocks the sequence holds as `sink_source`) by
    ws - s and written at positions ws-s..ws-1 of the table, in private blocks (copy-on-write: a shared
    or registered block is never changed). The scheduler gives those blocks (`place_sinks`), the model
    runner writes the rows before the forward. Only s rows per layer are rotated per step, not the tail;
  * so every query sees one run of keys, view start ws - s .. itself: `BatchInput.key_starts`, which the
    paged kernels take as their key range start. Blocks wholly before the view start are released.
Positions are text positions and so grow past max_position_embeddings in a long chat; RoPE needs only
their differences (at most the budget), but float32 angles lose about 6e-8 relative per position, which
`bench/bench_engine_policy.py` measures against PolicyCache at 10k tokens.

Prefix cache: a block computed after the first eviction holds K/V that depend on what was evicted (and on
the chunk schedule), so it is never registered; a sink block is a private copy. Blocks computed before
(no row dropped yet) equal full attention's, so they are registered as usual, and a policy request's hit
is capped below its budget (its first chunk then evicts nothing, as in the contiguous run).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvlab.cache.paged import BlockPool
from kvlab.engine.request import Sequence
from kvlab.policies.base import Policy
from kvlab.prefix.prefix_cache import PrefixCache

NULL_BLOCK = -1  # a block-table entry given back: positions there are never read again


@dataclass
class PolicyView:
    """A sequence's kept rows under a policy: text prefix [0, prefix) + text tail [window_start, computed)."""

    prefix: int = 0
    window_start: int = 0
    sink_source: list[int] = field(default_factory=list)  # blocks holding text rows 0..prefix-1 as computed

    @property
    def view_start(self) -> int:
        """First key position any query of this sequence sees (0 until something is evicted)."""
        return self.window_start - self.prefix

    @property
    def evicted(self) -> bool:
        return self.view_start > 0


def window_max_blocks(num_tokens: int, block_size: int, window: int | None,
                      max_num_batched_tokens: int | None) -> int:
    """Most blocks a sequence of `num_tokens` tokens holds at once in layers of this `window` (None: all of
    them): a chunk of up to max_num_batched_tokens new rows beside the window - 1 keys its first query still
    sees, +1 block where the window straddles a block boundary (vLLM's SlidingWindowManager bound)."""
    plain = -(-num_tokens // block_size)
    if window and max_num_batched_tokens:
        return min(plain, -(-(window - 1 + max_num_batched_tokens) // block_size) + 1)
    return plain


def held_blocks(seq: Sequence) -> list[int]:
    """The blocks a sequence references: its table without NULL entries, plus its sink source."""
    view = seq.kv_view
    return [b for b in seq.block_table if b != NULL_BLOCK] + (list(view.sink_source) if view else [])


def held_rows(seq: Sequence) -> int:
    """K/V rows the sequence's next query sees: every computed row, or a policy's kept prefix + tail."""
    view, computed = seq.kv_view, seq.num_computed_tokens
    return view.prefix + computed - view.window_start if view is not None and view.evicted else computed


class KVBounds:
    """What bounds a sequence's blocks: a sliding window (the model's) and/or a cache policy (the engine's)."""

    def __init__(self, pool: BlockPool, prefix_cache: PrefixCache, policy: Policy | None = None,
                 sliding_window: int | None = None, max_num_batched_tokens: int | None = None,
                 group: int = 0) -> None:
        """`group`: which of a sequence's block tables these bounds trim (kvlab/engine/kv_groups.py: a hybrid
        model's sliding layers have their own pool and table; a policy runs only on group 0)."""
        self.pool, self.prefix_cache = pool, prefix_cache
        self.policy, self.sliding_window = policy, sliding_window
        self.max_num_batched_tokens = max_num_batched_tokens
        self.group = group

    # --- limits --------------------------------------------------------------------------------------------
    @property
    def max_chunk(self) -> int | None:
        """Most tokens one step may compute for a sequence (the policy's max_chunk), None: no limit."""
        return self.policy.max_chunk if self.policy is not None else None

    @property
    def prefix_rows(self) -> int:
        """Rows a policy keeps at the start (sinks, context shift's n_keep)."""
        return int(getattr(self.policy, "sinks", getattr(self.policy, "n_keep", 0)))

    def max_blocks(self, num_tokens: int) -> int:
        """Most blocks a sequence of `num_tokens` tokens holds at once (the whole pool must fit it)."""
        if self.policy is not None:  # the view (budget rows, +1 block of misalignment) + the sink source
            return min(self.pool.blocks_for(num_tokens), self.pool.blocks_for(self.policy.budget) + 1
                       + self.pool.blocks_for(self.prefix_rows))
        return window_max_blocks(num_tokens, self.pool.block_size, self.sliding_window,
                                 self.max_num_batched_tokens)

    def rows_before_eviction(self, seq: Sequence) -> int | None:
        """New rows `seq` may write before its policy must evict (None: no policy, no limit)."""
        if self.policy is None:
            return None
        return self.policy.budget - held_rows(seq)

    def max_hit_blocks(self) -> int | None:
        """A policy request takes at most this many prefix-cache blocks: fewer rows than its budget, so its
        first chunk evicts nothing (the cached K/V are full attention's, as its own would be)."""
        return (self.policy.budget - 1) // self.pool.block_size if self.policy is not None else None

    # --- before a chunk ------------------------------------------------------------------------------------
    def evict(self, seq: Sequence, num_new: int) -> None:
        """Before `num_new` tokens of `seq` are computed: apply the policy's keep (as PolicyCache.make_room
        does on the reference cache) and release the blocks no query of this or a later step can see."""
        if self.policy is not None:
            self._keep(seq, num_new)
        self.trim(seq)

    def _keep(self, seq: Sequence, num_new: int) -> None:
        view = seq.kv_view
        if view is None:
            view = seq.kv_view = PolicyView()
        computed, length = seq.num_computed_tokens, held_rows(seq)
        if length + num_new <= self.policy.budget:
            return
        rows = np.asarray(self.policy.keep(length, num_new), dtype=np.int64)
        text = np.where(rows < view.prefix, rows, rows - view.prefix + view.window_start) if view.evicted \
            else rows
        prefix = 0
        while prefix < text.size and text[prefix] == prefix:
            prefix += 1
        tail = text[prefix:]
        if tail.size and not np.array_equal(tail, np.arange(computed - tail.size, computed)):
            raise ValueError(f"{self.policy} keeps rows that are not a prefix plus a tail: the paged engine "
                             "cannot place them")  # the engine's config refuses such policies first
        start = int(tail[0]) if tail.size else computed
        if start - prefix <= view.view_start:
            return  # nothing dropped
        if not view.sink_source and prefix:  # the first eviction: keep the prefix's blocks as computed
            view.sink_source = list(seq.block_table[:self.pool.blocks_for(prefix)])
            self.pool.acquire(view.sink_source)
        view.prefix, view.window_start = prefix, start

    def first_visible_block(self, seq: Sequence, num_computed: int) -> int:
        """Index of the first block a query at position `num_computed` or later can see: the blocks before it
        are never read again (a sliding window's, or a policy's evicted rows)."""
        first = 0
        if seq.kv_view is not None:
            first = seq.kv_view.view_start
        elif self.sliding_window:
            first = num_computed - self.sliding_window + 1
        return max(first, 0) // self.pool.block_size

    def trim(self, seq: Sequence) -> None:
        """Release the table's blocks wholly before every position a query may still see."""
        table = seq.block_tables[self.group]
        for index in range(min(self.first_visible_block(seq, seq.num_computed_tokens), len(table))):
            if table[index] != NULL_BLOCK:
                self.pool.release([table[index]])
                table[index] = NULL_BLOCK

    def sink_blocks_needed(self, seq: Sequence) -> int:
        """Free blocks `place_sinks` will take: one per shared block under the sink rows (a registered block
        only this sequence holds is released first and may come straight back, so it costs none)."""
        return sum(1 for index in self.sink_indices(seq)
                   if not self._private(seq, seq.block_table[index])
                   and self.pool.ref_counts[seq.block_table[index]] > 1)

    def sink_view(self, seq: Sequence) -> PolicyView | None:
        """`seq`'s view if it has sink rows to place before its rows this step (something evicted, a prefix
        kept); None otherwise."""
        view = seq.kv_view
        return view if view is not None and view.evicted and view.prefix else None

    def place_sinks(self, seq: Sequence) -> None:
        """Give the table entries under positions view_start..window_start-1 private blocks (copy-on-write),
        where the model runner writes the prefix rows re-rotated by view_start (ModelRunner.write_sinks)."""
        size = self.pool.block_size
        for index in self.sink_indices(seq):
            if not self._private(seq, seq.block_table[index]):  # rows past the sinks may be live tail rows
                self.pool.make_private(seq.block_table, index, size)

    def sink_indices(self, seq: Sequence) -> range:
        """Table indices the sink rows are written to this step (each becomes a private block)."""
        view = self.sink_view(seq)
        if view is None:
            return range(0)
        return range(view.view_start // self.pool.block_size, self.pool.blocks_for(view.window_start))

    def _private(self, seq: Sequence, block: int) -> bool:
        view = seq.kv_view
        return (self.pool.ref_counts[block] == 1 and self.prefix_cache.cached_info(block) is None
                and block not in view.sink_source)

    def key_start(self, seq: Sequence) -> int:
        """The first key position the sequence's queries see this step (the batch's key_starts)."""
        return seq.kv_view.view_start if seq.kv_view is not None else 0

    def registers(self, seq: Sequence) -> bool:
        """Whether the sequence's newly full blocks may enter the prefix cache (none after an eviction)."""
        return seq.kv_view is None or not seq.kv_view.evicted

    # --- sequence life -------------------------------------------------------------------------------------
    def release(self, seq: Sequence) -> None:
        """Give back the sink source and forget the view (finish, abort, preemption)."""
        if seq.kv_view is not None and seq.kv_view.sink_source:
            self.pool.release(seq.kv_view.sink_source)
        seq.kv_view = None

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares the parent's view; its sink source gets one more reference."""
        if parent.kv_view is not None:
            child.kv_view = PolicyView(parent.kv_view.prefix, parent.kv_view.window_start,
                                       list(parent.kv_view.sink_source))
            self.pool.acquire(child.kv_view.sink_source)
