"""Record what a paged engine computed, chunk by chunk, and replay it on the contiguous reference cache under
the same cache policy (PolicyCache, kvlab/verify/policy_reference.py): the engine with a policy must give
the logits the policy done by hand gives for the same chunks."""

from __future__ import annotations

import numpy as np

from kvlab.engine.kv_bounds import held_blocks
from kvlab.verify.policy_reference import PolicyCache


class Recorder:
    """Wraps `engine.runner.run`: each step's chunks (sequence, start, tokens) and sampled logits, and
    after each step the pool's invariants and the most blocks any sequence held."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.chunks: dict[tuple[str, int], list[tuple[int, list[int], np.ndarray | None]]] = {}
        self.max_held = 0
        inner = engine.runner.run

        def run(scheduled):
            starts = [(seq, seq.num_computed_tokens, n, list(seq.token_ids[seq.num_computed_tokens:
                                                                           seq.num_computed_tokens + n]))
                      for seq, n in scheduled]
            for seq, _ in scheduled:
                self.max_held = max(self.max_held, len(held_blocks(seq)))
            logits, sampled = inner(scheduled)
            rows = {id(seq): row for row, seq in enumerate(sampled)}
            for seq, start, n, ids in starts:
                out = logits[rows[id(seq)]].copy() if id(seq) in rows else None
                self.chunks.setdefault((seq.request.request_id, seq.index), []).append((start, ids, out))
            engine.block_pool.check_invariants()
            return logits, sampled

        engine.runner.run = run


def replay(model, policy, chunks, token_ids) -> list[tuple[np.ndarray, np.ndarray]]:
    """(engine logits, contiguous logits) for every sampled chunk of one sequence (all its tokens:
    `token_ids`), replayed in order. A chunk that does not continue the last one starts a new admission
    (first, or after a preemption); its prefix hit ran as full attention, so it is fed first, below the
    policy's budget (the engine caps hits there)."""
    pairs, cache, end = [], None, None
    for start, ids, engine_logits in chunks:
        if cache is None or start != end:
            cache = PolicyCache(model, policy)
            for piece in range(0, start, policy.max_chunk):
                part = token_ids[piece:min(piece + policy.max_chunk, start)]
                cache.feed(part)
                assert cache.evicted == 0  # a hit is below the budget
        logits = cache.feed(ids)[-1]
        end = start + len(ids)
        if engine_logits is not None:
            pairs.append((engine_logits, logits))
    return pairs
