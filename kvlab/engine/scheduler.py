"""The scheduler: which sequences run in the next step, with how many tokens, in which blocks.

Each step (vLLM v1's rule, decodes first): every running sequence that needs one token (a decode) is
scheduled, then running prefills get chunks, then waiting sequences are admitted, all under
`max_num_batched_tokens` tokens and `max_num_seqs` sequences. Blocks are allocated only for the tokens a
step computes. When the pool runs out, the most recently admitted running sequence is preempted by
recompute: its blocks are released (its full blocks stay cached, so re-admission hits them) and it goes
back to the front of the waiting queue, keeping the tokens it generated. A waiting sequence starts from
its longest prefix-cache hit, in whole blocks, always computing its last token.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvlab.cache.paged import BlockPool
from kvlab.engine.request import Sequence, Status
from kvlab.prefix.prefix_cache import PrefixCache


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, tokens this step)
    too_long: list[Sequence] = field(default_factory=list)  # outgrew the whole pool: removed, to finish


class Scheduler:
    """Waiting queue, running list, and the block bookkeeping of admission, growth and preemption."""

    def __init__(self, pool: BlockPool, prefix_cache: PrefixCache, max_num_seqs: int,
                 max_num_batched_tokens: int) -> None:
        self.pool = pool
        self.prefix_cache = prefix_cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.prefix_cache_queries = 0  # tokens looked up, every admission
        self.prefix_cache_hits = 0     # tokens found
        self._admissions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def running_seats(self) -> int:
        return sum(s.seats for s in self.running)

    # --- one step ------------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        scheduled: dict[Sequence, int] = {}
        budget = self.max_num_batched_tokens
        preempted = False
        for seq in sorted(self.running, key=lambda s: s.num_tokens - s.num_computed_tokens > 1):
            if budget == 0:
                break
            if seq.status is not Status.RUNNING:
                continue  # preempted earlier in this step
            if self.pool.blocks_for(seq.num_tokens) > self.pool.num_blocks:
                self.remove(seq)
                out.too_long.append(seq)
                continue
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while self._blocks_needed(seq, num_new) > self.pool.num_free_blocks:
                victim = max(self.running, key=lambda s: (s.admitted_at, s.index))
                budget += scheduled.pop(victim, 0)
                self.preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:
                continue
            self._grow(seq, num_new)
            scheduled[seq] = num_new
            budget -= num_new
        if not preempted:  # as vLLM: no admissions in a step that had to preempt
            budget = self._admit(scheduled, budget, out)
        out.scheduled = list(scheduled.items())
        return out

    def _admit(self, scheduled: dict[Sequence, int], budget: int, out: SchedulerOutput) -> int:
        size = self.pool.block_size
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if self.running_seats() + seq.seats > self.max_num_seqs:
                break
            if self.pool.blocks_for(seq.num_tokens) > self.pool.num_blocks:
                self.waiting.popleft()
                out.too_long.append(seq)
                continue
            hits, keys = self.prefix_cache.match(seq.token_ids, seq.request.root_key)
            hits = hits[:(seq.num_tokens - 1) // size]  # the last token is always computed
            num_cached = len(hits) * size
            num_new = min(seq.num_tokens - num_cached, budget)
            total = self.pool.blocks_for(num_cached + num_new)
            revived = sum(1 for b in hits if self.pool.ref_counts[b] == 0)  # cached blocks leaving the LRU
            if total - len(hits) + revived > self.pool.num_free_blocks:
                break
            self.waiting.popleft()
            self.pool.acquire(hits)
            seq.block_table = hits + self.pool.allocate(total - len(hits))
            seq.block_keys = keys[:len(hits)]
            seq.num_computed_tokens = num_cached
            if self.prefix_cache.enabled:
                self.prefix_cache_queries += seq.num_tokens
                self.prefix_cache_hits += num_cached
            if not seq.request.admitted:
                seq.request.admitted = True
                seq.request.num_cached_tokens = num_cached
            self._start(seq, self._admissions)
            self._admissions += 1
            scheduled[seq] = num_new
            budget -= num_new
        return budget

    # --- blocks --------------------------------------------------------------------------------------------
    def _blocks_needed(self, seq: Sequence, num_new: int) -> int:
        start = seq.num_computed_tokens
        need = self.pool.blocks_for(start + num_new) - len(seq.block_table)
        if self._shared_tail(seq):
            need += 1  # copy-on-write of a partially filled block shared with a fork
        return need

    def _shared_tail(self, seq: Sequence) -> bool:
        start = seq.num_computed_tokens
        return start % self.pool.block_size != 0 and \
            self.pool.ref_counts[seq.block_table[start // self.pool.block_size]] > 1

    def _grow(self, seq: Sequence, num_new: int) -> None:
        """Give `seq` the blocks its next `num_new` tokens are written into."""
        if self._shared_tail(seq):
            index = seq.num_computed_tokens // self.pool.block_size
            [copy] = self.pool.allocate(1)
            self.pool.copy_block(seq.block_table[index], copy, seq.num_computed_tokens % self.pool.block_size)
            self.pool.release([seq.block_table[index]])
            seq.block_table[index] = copy
        more = self.pool.blocks_for(seq.num_computed_tokens + num_new) - len(seq.block_table)
        seq.block_table.extend(self.pool.allocate(more))

    # --- state changes -------------------------------------------------------------------------------------
    def _start(self, seq: Sequence, admitted_at: int) -> None:
        seq.status = Status.RUNNING
        seq.admitted_at = admitted_at
        self.running.append(seq)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Start `child` as a copy of `parent` sharing all its blocks (copy-on-write on its first write)."""
        child.token_ids = list(parent.token_ids)
        child.num_computed_tokens = parent.num_computed_tokens
        child.block_table = list(parent.block_table)
        child.block_keys = list(parent.block_keys)
        self.pool.acquire(child.block_table)
        self._start(child, parent.admitted_at)

    def preempt(self, seq: Sequence) -> None:
        """Free `seq`'s blocks and queue it first for re-admission; it keeps its generated tokens."""
        self.remove(seq)
        seq.num_computed_tokens = 0
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def remove(self, seq: Sequence) -> None:
        """Take `seq` out of the queues and release its blocks (finish, abort, preempt)."""
        if seq.status is Status.RUNNING and seq in self.running:
            self.running.remove(seq)
        elif seq.status is Status.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self.pool.release(seq.block_table)
        seq.block_table = []
        seq.block_keys = []
