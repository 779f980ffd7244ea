"""Cache policies' block bookkeeping in the paged engine (kvlab/engine/kv_bounds.py) seen from the pool: what
a sequence holds after an eviction (its table's live entries and the sink source: `held_blocks`, which the
policy tests and the bench measure), and copy-on-write only of blocks that are not the sequence's alone
(a sink block already private is written in place, never copied again)."""

from __future__ import annotations

from kvlab import Engine, SamplingParams, TinyLlama
from kvlab.engine.kv_bounds import NULL_BLOCK, held_blocks
from kvlab.policies import AttentionSinks, ContextShift

MODEL = TinyLlama(seed=5)
GREEDY = {"ignore_eos": True, "temperature": 0.0}


def watch(engine: Engine) -> list[tuple[int, int]]:
    """Wrap the pool's make_private: record (ref count, block) of every block it is asked to copy, after
    checking that block is shared (ref > 1), registered in the prefix cache, or some sequence's sink source;
    and after each step check held_blocks against the pool's own counts."""
    pool, cache, scheduler = engine.block_pool, engine.prefix_cache, engine.scheduler
    copied: list[tuple[int, int]] = []
    inner = pool.make_private

    def make_private(table, index, num_tokens):
        block = table[index]
        sources = {b for seq in scheduler.running if seq.kv_view is not None for b in seq.kv_view.sink_source}
        assert pool.ref_counts[block] > 1 or cache.cached_info(block) is not None or block in sources, \
            f"block {block} (ref {pool.ref_counts[block]}) is private: copying it is wasted"
        copied.append((pool.ref_counts[block], block))
        inner(table, index, num_tokens)

    pool.make_private = make_private
    run = engine.runner.run

    def checked(scheduled):
        out = run(scheduled)
        in_use = {b for b, r in enumerate(pool.ref_counts) if r > 0}
        held = [b for seq in scheduler.running for b in held_blocks(seq)]
        assert sorted(set(held)) == sorted(in_use)
        refs = {b: held.count(b) for b in in_use}
        assert all(refs[b] == pool.ref_counts[b] for b in in_use)  # one reference per holder, sink source included
        return out

    engine.runner.run = checked
    return copied


def test_held_blocks_are_the_live_table_entries_and_the_sink_source() -> None:
    policy = AttentionSinks(3, 9)
    engine = Engine(MODEL, block_size=4, num_blocks=20, max_num_batched_tokens=4, kv_policy=policy,
                    enable_prefix_caching=False)
    watch(engine)
    engine.add_request("a", list(range(40, 70)), SamplingParams(max_tokens=6, **GREEDY))
    evicted = False
    while engine.has_unfinished_requests():
        engine.step()
        for seq in engine.scheduler.running:
            view = seq.kv_view
            if view is not None and view.evicted and view.sink_source:
                evicted = True
                live = [b for b in seq.block_table if b != NULL_BLOCK]
                assert held_blocks(seq) == live + view.sink_source
                assert NULL_BLOCK in seq.block_table  # evicted rows' blocks went back
    assert evicted


def test_sink_blocks_are_copied_only_while_shared() -> None:
    """With prefix caching on, the sink rows land in registered blocks first (copied), then in the sequence's
    own blocks, which are written in place."""
    for policy in (AttentionSinks(3, 9), ContextShift(2, 10)):
        engine = Engine(MODEL, block_size=4, num_blocks=24, max_num_batched_tokens=4, kv_policy=policy)
        copied = watch(engine)
        prompt = list(range(40, 80))
        engine.generate([prompt[:8]], SamplingParams(max_tokens=1, **GREEDY))  # registers two blocks
        [out] = engine.generate([prompt], SamplingParams(max_tokens=8, **GREEDY))
        assert len(out.outputs[0].token_ids) == 8
        assert copied  # the registered blocks under the sink rows were copied
        engine.block_pool.check_invariants()
        assert engine.block_pool.num_used_blocks == 0


def test_forked_samples_each_copy_their_shared_sink_blocks() -> None:
    engine = Engine(MODEL, block_size=4, num_blocks=40, max_num_batched_tokens=5, kv_policy=AttentionSinks(2, 10),
                    enable_prefix_caching=False)
    copied = watch(engine)
    [out] = engine.generate([list(range(20, 50))], SamplingParams(n=3, max_tokens=12, temperature=1.0, seed=3))
    assert len(out.outputs) == 3 and all(len(o.token_ids) == 12 for o in out.outputs)
    assert any(ref > 1 for ref, _ in copied)  # the samples shared the blocks under their sink rows
    engine.block_pool.check_invariants()
