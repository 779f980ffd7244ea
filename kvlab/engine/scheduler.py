"""The scheduler: which sequences run in the next step, with how many tokens, in which blocks.

Each step (vLLM v1's rule, decodes first): every running sequence that needs one token (a decode) is
scheduled, then running prefills get chunks, then waiting sequences are admitted, all under
`max_num_batched_tokens` tokens and `max_num_seqs` sequences. Blocks are allocated only for the tokens a
step computes. When the pool runs out, the most recently admitted running sequence is preempted by
recompute: its blocks are released (its full blocks stay cached, so re-admission hits them) and it goes
back to the front of the waiting queue, keeping the tokens it generated. A waiting sequence starts from
its longest prefix-cache hit — whole blocks, then the rows of a cached tail (kvlab/prefix/prefix_cache.py)
copied into a private block — always computing its last token; a tail copy that does not fit is recomputed
instead, so a tail never keeps a request waiting.

Sliding-window models and cache policies bound what a sequence holds (kvlab/engine/kv_bounds.py): before
each chunk the bounds evict what the policy drops and release blocks no query can see again; a policy
caps each chunk at its max_chunk and each prefix hit below its budget. A hybrid model's layer types are
KV-cache groups (kvlab/engine/kv_groups.py), each with its own pool and a table per sequence: a step runs a
sequence only if every group has the blocks it needs (else the newest is preempted), and a waiting sequence
is admitted only if every group can hold its first chunk.

The scheduler only schedules: sampling, detokenizing and stop rules are the output stage's
(kvlab/engine/output_processor.py), which calls `fork` and `finish` here for their blocks. A policy's sink
rows get their private blocks here (`KVBounds.place_sinks`); the model runner writes their K/V.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvlab.cache.paged import BlockPool
from kvlab.engine.kv_bounds import NULL_BLOCK, KVBounds
from kvlab.engine.kv_groups import CacheGroup, longest_hit
from kvlab.engine.request import Sequence, Status
from kvlab.prefix.prefix_cache import PrefixCache


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, tokens this step)
    too_long: list[Sequence] = field(default_factory=list)  # outgrew the whole pool: removed, to finish


class Scheduler:
    """Waiting queue, running list, and the block bookkeeping of admission, growth and preemption."""

    def __init__(self, pool: BlockPool, prefix_cache: PrefixCache, max_num_seqs: int,
                 max_num_batched_tokens: int, bounds: KVBounds | None = None,
                 groups: list[CacheGroup] | None = None) -> None:
        """`groups`: every KV-cache group, group 0 being (pool, prefix_cache, bounds); None: that one alone."""
        self.pool = pool
        self.prefix_cache = prefix_cache
        self.bounds = bounds if bounds is not None else KVBounds(pool, prefix_cache)
        self.groups = groups if groups is not None else [
            CacheGroup(0, self.bounds.sliding_window, (), pool, prefix_cache, self.bounds)]
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._admissions = 0
        # nothing bounds a sequence's blocks but its length (one group, no window, no policy): evict and
        # place_sinks are no-ops, so a step skips them
        self._unbounded = len(self.groups) == 1 and all(
            b.policy is None and b.sliding_window is None for b in (self.bounds, self.groups[0].bounds))

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
        running = self.running
        order = list(running) if len(running) < 2 else \
            sorted(running, key=lambda s: s.num_tokens - s.num_computed_tokens > 1)
        for seq in order:
            if budget == 0:
                break
            if seq.status is not Status.RUNNING:
                continue  # preempted earlier in this step
            if self._too_long(seq.num_tokens):
                self.remove(seq)
                out.too_long.append(seq)
                continue
            unseen = seq.num_tokens - seq.num_computed_tokens
            num_new = min(unseen + len(seq.draft), budget, self._chunk_cap())
            seq.draft = seq.draft[:max(num_new - unseen, 0)]  # guesses ride along only where they fit
            if not self._unbounded:
                for group in self.groups:
                    group.bounds.evict(seq, num_new)
            while (short := self._short_group(seq, num_new)) is not None:
                victim = max(self.running, key=lambda s: (s.admitted_at, s.index))
                if victim is seq and len(self.running) == 1:
                    # alone, every other block is free or evictable: waiting cannot help, and re-admission
                    # would come back here (a livelock). EngineConfig refuses pools this small; reaching
                    # this line is a bug, so say so instead of spinning (docs/ARCHITECTURE.md, liveness).
                    raise RuntimeError(
                        f"liveness: sequence {seq.request.request_id}#{seq.index} alone in the pool needs "
                        f"{self._blocks_needed(seq, num_new, short)} free blocks of KV-cache group "
                        f"{short.index} for {num_new} tokens but {short.pool.num_free_blocks} of "
                        f"{short.pool.num_blocks} are free")
                budget += scheduled.pop(victim, 0)
                self.preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:
                continue
            if not self._unbounded:
                self.bounds.place_sinks(seq)
            for group in self.groups:
                self._grow(group, seq, num_new)
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
            if self._too_long(seq.num_tokens):
                self.waiting.popleft()
                out.too_long.append(seq)
                continue
            hits, keys = self.prefix_cache.match(seq.token_ids, seq.request.root_key)
            hits = hits[:(seq.num_tokens - 1) // size]  # the last token is always computed
            if self.bounds.max_hit_blocks() is not None:
                hits = hits[:self.bounds.max_hit_blocks()]
            found: list[list[int]] = []  # the other groups' cached blocks, from their first visible one
            if len(self.groups) > 1:  # a hybrid hit counts only where every group has what it reads
                num_hit, found = longest_hit(self.groups, seq, keys[:len(hits)])
                hits = hits[:num_hit]
            tail = self._tail_hit(seq, hits, keys[:len(hits)])  # (cached block, rows) continuing the hit, or None
            for tail in [tail, None] if tail is not None else [None]:  # a tail that does not fit: recompute it
                num_cached = len(hits) * size + (tail[1] if tail is not None else 0)
                num_new, plans, fits = self._plan(seq, hits, found, tail, num_cached, budget)
                if fits:
                    break
            if not fits:
                break
            self.waiting.popleft()
            for group, first, kept, total in plans:
                group.pool.acquire(kept)
                if tail is not None and group.index == 0:  # a private copy of the tail's rows, written on from there
                    group.pool.acquire([tail[0]])
                    new = group.pool.allocate(total - len(kept))
                    group.pool.copy_block(tail[0], new[0], tail[1])
                    group.pool.release([tail[0]])
                else:
                    new = group.pool.allocate(total - len(kept))
                seq.block_tables[group.index] = [NULL_BLOCK] * first + kept + new
            seq.block_keys = keys[:len(hits)]
            seq.num_computed_tokens = num_cached
            self.prefix_cache.record(seq.num_tokens, num_cached)
            if not seq.request.admitted:
                seq.request.admitted = True
                seq.request.num_cached_tokens = num_cached
            self._start(seq, self._admissions)
            self._admissions += 1
            scheduled[seq] = num_new
            budget -= num_new
        return budget

    def _plan(self, seq: Sequence, hits: list[int], found: list[list[int]], tail: tuple[int, int] | None,
              num_cached: int, budget: int) -> tuple[int, list, bool]:
        """The first chunk of a waiting `seq` admitted with `num_cached` tokens cached: (its tokens, per group
        (group, first visible block, cached blocks kept, blocks in all), whether every group has them free)."""
        num_new = min(seq.num_tokens - num_cached, budget, self._chunk_cap())
        if self.bounds.policy is not None:  # the first chunk evicts nothing (see max_hit_blocks)
            num_new = min(num_new, self.bounds.policy.budget - num_cached)
        # a sliding window's hit takes only the blocks its queries still see (vLLM's rule); taking every
        # hit could need more blocks than the pool has, and the request waited forever (issue 32)
        plans, fits = [], True
        for group, cached in zip(self.groups, [hits] + found):
            first = min(group.bounds.first_visible_block(seq, num_cached), len(hits))
            kept = cached[first:] if group.index == 0 else cached
            total = group.pool.blocks_for(num_cached + num_new) - first
            revived = sum(1 for b in kept if group.pool.ref_counts[b] == 0)  # cached blocks leaving the LRU
            if tail is not None and group.index == 0 and group.pool.ref_counts[tail[0]] == 0:
                revived += 1  # a cached tail, held (out of the LRU) while it is copied
            plans.append((group, first, kept, total))
            fits = fits and total - len(kept) + revived <= group.pool.num_free_blocks
        return num_new, plans, fits

    # --- blocks --------------------------------------------------------------------------------------------
    def _keeps_tails(self) -> bool:
        """Whether partially filled last blocks are cached (kvlab/prefix/prefix_cache.py: token-granular
        reuse): one KV-cache group, no cache policy, no sliding window (their blocks leave the table)."""
        return (self.prefix_cache.enabled and len(self.groups) == 1 and self.bounds.policy is None
                and self.groups[0].window is None)

    def _tail_hit(self, seq: Sequence, hits: list[int], keys: list[bytes]) -> tuple[int, int] | None:
        """The cached block (block, rows) whose first rows continue `hits` (a tail, or a full block that parts
        from the prompt inside it), its rows capped so the last token is still computed."""
        if not self._keeps_tails():
            return None
        start = len(hits) * self.pool.block_size
        found = self.prefix_cache.match_tail(seq.token_ids, keys[-1] if keys else seq.request.root_key, start)
        if found is None or min(found[1], seq.num_tokens - 1 - start) <= 0:
            return None
        return found[0], min(found[1], seq.num_tokens - 1 - start)

    def _chunk_cap(self) -> int:
        cap = self.bounds.max_chunk
        return cap if cap is not None else self.max_num_batched_tokens

    def _too_long(self, num_tokens: int) -> bool:
        """Whether a sequence of `num_tokens` outgrows some group's whole pool (it could never run)."""
        return any(g.bounds.max_blocks(num_tokens) > g.pool.num_blocks for g in self.groups)

    def _short_group(self, seq: Sequence, num_new: int) -> CacheGroup | None:
        """The first group without the free blocks this step takes for `seq`; None: every group has them."""
        return next((g for g in self.groups if self._blocks_needed(seq, num_new, g) > g.pool.num_free_blocks),
                    None)

    def _blocks_needed(self, seq: Sequence, num_new: int, group: CacheGroup | None = None) -> int:
        """Free blocks of `group` (default: group 0) this step takes for `seq`: its growth, the private copies
        of its sink rows, and the copy-on-write of a partially filled last block, counted once when the sinks'
        copy already makes that block private (counting it twice made a lone request preempt itself forever:
        issue 32)."""
        group = group if group is not None else self.groups[0]
        start = seq.num_computed_tokens
        need = group.pool.blocks_for(start + num_new) - len(group.table(seq)) + group.bounds.sink_blocks_needed(seq)
        if self._shared_tail(group, seq) and start // group.pool.block_size not in group.bounds.sink_indices(seq):
            need += 1  # copy-on-write of a partially filled block shared with a fork
        return need

    def _shared_tail(self, group: CacheGroup, seq: Sequence) -> bool:
        start, size = seq.num_computed_tokens, group.pool.block_size
        return start % size != 0 and group.pool.ref_counts[group.table(seq)[start // size]] > 1

    def _grow(self, group: CacheGroup, seq: Sequence, num_new: int) -> None:
        """Give `seq` the blocks of `group` its next `num_new` tokens are written into."""
        pool, table = group.pool, group.table(seq)
        if self._shared_tail(group, seq):
            pool.make_private(table, seq.num_computed_tokens // pool.block_size,
                              seq.num_computed_tokens % pool.block_size)
        more = pool.blocks_for(seq.num_computed_tokens + num_new) - len(table)
        if more > 0:  # most decode steps write into the last block they hold
            table.extend(pool.allocate(more))

    # --- state changes -------------------------------------------------------------------------------------
    def _start(self, seq: Sequence, admitted_at: int) -> None:
        seq.status = Status.RUNNING
        seq.admitted_at = admitted_at
        self.running.append(seq)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Start `child` as a copy of `parent` sharing all its blocks (copy-on-write on its first write)."""
        child.token_ids = list(parent.token_ids)
        child.num_computed_tokens = parent.num_computed_tokens
        child.block_tables = [list(table) for table in parent.block_tables]
        child.block_keys = list(parent.block_keys)
        for group in self.groups:
            group.pool.acquire(group.held(child))
        self.bounds.fork(parent, child)
        self._start(child, parent.admitted_at)

    def preempt(self, seq: Sequence) -> None:
        """Free `seq`'s blocks and queue it first for re-admission; it keeps its generated tokens."""
        self.remove(seq)
        seq.num_computed_tokens = 0
        seq.draft = []
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence) -> None:
        """Take `seq` out of scheduling for good and give its blocks back (a sample still waiting to fork
        holds none); why it ended is the output stage's (kvlab/engine/output_processor.py)."""
        if seq.status is not Status.PENDING_FORK:
            self.remove(seq)
        seq.status = Status.FINISHED

    def remove(self, seq: Sequence) -> None:
        """Take `seq` out of the queues and release its blocks (finish, abort, preempt)."""
        if seq.status is Status.RUNNING and seq in self.running:
            self.running.remove(seq)
        elif seq.status is Status.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        size, table = self.pool.block_size, self.groups[0].table(seq)
        computed = seq.num_computed_tokens
        if self._keeps_tails() and computed % size and len(seq.block_keys) == computed // size \
                and computed // size < len(table):  # its partial last block stays findable (cache_tail)
            self.prefix_cache.cache_tail(table[computed // size],
                                         seq.block_keys[-1] if seq.block_keys else seq.request.root_key,
                                         seq.token_ids[computed - computed % size:computed])
        for group in self.groups:
            group.pool.release(group.held(seq))
        self.bounds.release(seq)
        seq.block_tables = [[] for _ in seq.block_tables]
        seq.block_keys = []
