"""Bounded memory in the paged engine (kvlab/engine/kv_bounds.py): cache policies (window, sinks, shift)
give the logits of the policy done by hand on the contiguous reference cache (kvlab/verify/policy_reference.py)
for the same chunks, sliding-window models give full recompute's, and
both hold a bounded number of blocks; blocks computed after an eviction never serve a full-attention
request; bad settings are refused before anything is allocated."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import kvlab
from engine_replay import Recorder, replay
from kvlab import Engine, SamplingParams, TinyLlama
from kvlab.engine.kv_bounds import NULL_BLOCK, held_blocks
from kvlab.errors import ConfigError, InputError
from kvlab.policies import AttentionSinks, ContextShift, Policy, SlidingWindow
from kvlab.verify.policy_reference import PolicyCache, greedy_tokens

GREEDY = dict(ignore_eos=True)
MODEL = TinyLlama(seed=5)  # float64: engine and contiguous logits agree to ~1e-15


def policies():
    window = st.integers(2, 24).map(SlidingWindow)
    sinks = st.integers(0, 4).flatmap(lambda s: st.integers(s + 1, 24).map(lambda w: AttentionSinks(s, w)))
    shift = st.integers(0, 4).flatmap(lambda k: st.integers(k + 2, 24).map(lambda b: ContextShift(k, b)))
    return st.one_of(window, sinks, shift)


def check_bounded_and_equal(engine, recorder, policy, outputs, bound):
    worst = 0.0
    for out in outputs:
        tokens = out.prompt_token_ids + out.outputs[0].token_ids
        pairs = replay(MODEL, policy, recorder.chunks[(out.request_id, 0)], tokens)
        assert pairs  # every sequence was sampled at least once
        for paged, contiguous in pairs:
            worst = max(worst, float(np.abs(paged - contiguous).max()))
            assert int(np.argmax(paged)) == int(np.argmax(contiguous))
    assert worst < 1e-9, worst
    assert recorder.max_held <= bound
    pool = engine.block_pool
    pool.check_invariants()
    assert pool.num_used_blocks == 0 and pool.num_free_blocks == pool.num_blocks


# --- policies: the contiguous policy's logits, bounded blocks --------------------------------------------
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(policy=policies(), block_size=st.sampled_from([1, 2, 4, 8]), chunk=st.integers(1, 24),
       lengths=st.lists(st.integers(1, 70), min_size=1, max_size=4), new=st.integers(1, 24),
       shared=st.booleans(), prefix_caching=st.booleans(), room=st.floats(0, 1))
def test_policy_engine_equals_contiguous_policy_with_bounded_blocks(policy, block_size, chunk, lengths, new,
                                                                   shared, prefix_caching, room):
    """Pools from one sequence's bound (others wait or are preempted and recomputed) to all of them."""
    bound = (-(-policy.budget // block_size) + 1
             + -(-getattr(policy, "sinks", getattr(policy, "n_keep", 0)) // block_size))
    num_blocks = bound + int(room * bound * (len(lengths) - 1))
    engine = Engine(MODEL, block_size=block_size, num_blocks=num_blocks, max_num_seqs=4,
                    max_num_batched_tokens=chunk, enable_prefix_caching=prefix_caching, kv_policy=policy)
    recorder = Recorder(engine)
    base = list(range(3, 3 + max(lengths)))
    prompts = [base[:n] if shared else [(7 * i + 3 * t) % 250 for t in range(n)]
               for i, n in enumerate(lengths)]
    outputs = engine.generate(prompts, SamplingParams(max_tokens=new, **GREEDY))
    if num_blocks == bound * len(lengths):
        assert engine.scheduler.num_preemptions == 0  # the pool holds every sequence's bound at once
    check_bounded_and_equal(engine, recorder, policy, outputs, bound)


def test_a_10x_longer_conversation_than_the_pool_with_the_goals_ratios():
    """The 10k-token goal's shape scaled down: context 8x the pool (8192 / 2048 -> 64 / 16 blocks of 4
    tokens = 64 tokens), a conversation ~1.2x the context, a sinks policy sized to the pool."""
    model = TinyLlama(seed=5, max_position_embeddings=512)
    policy = AttentionSinks(4, 52)
    engine = Engine(model, block_size=4, num_blocks=16, max_num_batched_tokens=16, kv_policy=policy)
    recorder = Recorder(engine)
    prompt = [(5 * t) % 250 for t in range(600)]  # past the 512-token context
    [out] = engine.generate([prompt], SamplingParams(max_tokens=40, **GREEDY))
    assert len(out.outputs[0].token_ids) == 40
    tokens = prompt + out.outputs[0].token_ids
    pairs = replay(model, policy, recorder.chunks[(out.request_id, 0)], tokens)
    assert max(float(np.abs(a - b).max()) for a, b in pairs) < 1e-9
    assert recorder.max_held <= 16 and engine.stats()["num_preemptions"] == 0
    # the same tokens as the policy by hand, which runs the prompt in chunks of max_chunk
    alone = Engine(model, block_size=4, num_blocks=16, max_num_batched_tokens=policy.max_chunk,
                   kv_policy=policy)
    [again] = alone.generate([prompt], SamplingParams(max_tokens=40, **GREEDY))
    assert again.outputs[0].token_ids == greedy_tokens(model, policy, prompt, 40)


@pytest.mark.parametrize("kv_dtype", ["int8", "float16"])
def test_a_low_precision_pool_runs_a_policy_bounded_and_close_to_the_float_policy_by_hand(kv_dtype):
    """Sink rows are dequantized, rotated and written back once per eviction, the tail kept as stored: the
    pool differs from the float policy by hand (PolicyCache) by the storage's rounding, not by which keys it
    sees."""
    model = TinyLlama(seed=5, dtype=np.float32)
    policy = AttentionSinks(3, 13)
    engine = Engine(model, block_size=4, num_blocks=6, max_num_batched_tokens=5, kv_policy=policy,
                    kv_cache_dtype=kv_dtype)
    recorder = Recorder(engine)
    prompt = [(9 * t) % 250 for t in range(70)]
    [out] = engine.generate([prompt], SamplingParams(max_tokens=10, **GREEDY))
    assert recorder.max_held <= 6
    pairs = []
    cache, end = PolicyCache(model, policy), 0
    for start, ids, logits in recorder.chunks[(out.request_id, 0)]:
        assert start == end
        reference = cache.feed(ids)[-1]
        end = start + len(ids)
        if logits is not None:
            pairs.append((logits, reference))
    spread = max(float(np.abs(r).max()) for _, r in pairs)
    assert max(float(np.abs(a - b).max()) for a, b in pairs) < 0.01 * spread  # measured: 0.27 % int8, 0.012 % float16
    engine.block_pool.check_invariants()
    assert engine.block_pool.num_used_blocks == 0


def test_forks_share_a_policy_prefix_and_get_their_own_sink_blocks():
    policy = AttentionSinks(2, 10)
    engine = Engine(MODEL, block_size=4, num_blocks=30, max_num_batched_tokens=5, kv_policy=policy)
    recorder = Recorder(engine)
    [out] = engine.generate([list(range(20, 50))], SamplingParams(n=3, max_tokens=12, temperature=1.0, seed=3))
    for index, sample in enumerate(out.outputs):
        tokens = out.prompt_token_ids + sample.token_ids
        chunks = recorder.chunks[(out.request_id, index)]
        if index:  # a fork starts where sample 0 finished the prompt: replay the shared chunks first
            chunks = recorder.chunks[(out.request_id, 0)][:_prompt_chunks(recorder, out)] + chunks
        for paged, contiguous in replay(MODEL, policy, chunks, tokens):
            assert np.abs(paged - contiguous).max() < 1e-9
    engine.block_pool.check_invariants()
    assert engine.block_pool.num_used_blocks == 0


def test_forked_samples_one_block_short_wait_for_their_copies():
    """Two samples fork after a sinks eviction, sharing the blocks under the sink rows and the partial last
    block: the first write needs a private copy of both, so with one block to spare the newer sample is
    preempted (and recomputed), never written past the pool; both get the contiguous policy's logits."""
    policy = AttentionSinks(2, 10)
    engine = Engine(MODEL, block_size=4, num_blocks=6, max_num_seqs=2, kv_policy=policy)
    recorder = Recorder(engine)
    prompt = [(7 * t + 3) % 250 for t in range(13)]
    [out] = engine.generate([prompt], SamplingParams(n=2, max_tokens=6, temperature=0.8, seed=3))
    assert engine.scheduler.num_preemptions > 0
    for index, sample in enumerate(out.outputs):
        assert len(sample.token_ids) == 6
        chunks = recorder.chunks[(out.request_id, index)]
        if index:
            chunks = recorder.chunks[(out.request_id, 0)][:_prompt_chunks(recorder, out)] + chunks
        for paged, contiguous in replay(MODEL, policy, chunks, out.prompt_token_ids + sample.token_ids):
            assert np.abs(paged - contiguous).max() < 1e-9
    engine.block_pool.check_invariants()
    assert engine.block_pool.num_used_blocks == 0


def _prompt_chunks(recorder, out) -> int:
    chunks = recorder.chunks[(out.request_id, 0)]
    return next(i for i, (start, ids, _) in enumerate(chunks) if start + len(ids) == len(out.prompt_token_ids)) + 1


# --- sliding-window models: full recompute's logits, blocks outside the window released -------------------
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(window=st.integers(2, 20), block_size=st.sampled_from([1, 2, 4, 8]), chunk=st.integers(1, 16),
       lengths=st.lists(st.integers(1, 60), min_size=1, max_size=3), new=st.integers(1, 16))
def test_sliding_window_model_releases_blocks_outside_every_window(window, block_size, chunk, lengths, new):
    model = TinyLlama(seed=2, sliding_window=window)
    bound = -(-(window - 1 + chunk) // block_size) + 1
    engine = Engine(model, block_size=block_size, num_blocks=bound * len(lengths) + 1,
                    max_num_batched_tokens=chunk, max_num_seqs=3)
    recorder = Recorder(engine)
    prompts = [[(11 * i + t) % 250 for t in range(n)] for i, n in enumerate(lengths)]
    outputs = engine.generate(prompts, SamplingParams(max_tokens=new, **GREEDY))
    for out in outputs:
        tokens = out.prompt_token_ids + out.outputs[0].token_ids
        for start, ids, logits in recorder.chunks[(out.request_id, 0)]:
            if logits is not None:
                full = model.forward(np.asarray([tokens[:start + len(ids)]])).logits[0, -1]
                assert np.abs(logits - full).max() < 1e-9
    assert recorder.max_held <= bound
    engine.block_pool.check_invariants()
    assert engine.block_pool.num_used_blocks == 0


def test_a_sliding_window_request_may_start_from_a_long_prefix_hit():
    model = TinyLlama(seed=2, sliding_window=6)
    engine = Engine(model, block_size=4, num_blocks=12, max_num_batched_tokens=8)
    prompt = list(range(5, 45))
    first = engine.generate([prompt], SamplingParams(max_tokens=4, **GREEDY))[0]
    recorder = Recorder(engine)
    second = engine.generate([prompt + [9]], SamplingParams(max_tokens=4, **GREEDY))[0]
    assert second.num_cached_tokens > 0
    assert recorder.max_held <= -(-(6 - 1 + 8) // 4) + 1
    tokens = prompt + [9] + second.outputs[0].token_ids
    full = model.forward(np.asarray([tokens[:-1]])).logits[0, -1]
    assert int(np.argmax(full)) == tokens[-1]
    assert first.outputs[0].token_ids == kvlab.generate(model, [prompt], 4)[0].tolist()


# --- the prefix cache and the policy agree on what a block means ------------------------------------------
def test_blocks_after_an_eviction_are_never_a_full_attention_hit(tmp_path):
    """A policy engine and a full-attention engine share a disk tier: only blocks computed before the
    first eviction (equal to full attention's) reach it, and the full-attention request's logits are full
    recompute's. Inside the policy engine no post-eviction block is registered either."""
    url = f"file://{tmp_path}/tier"
    policy = AttentionSinks(2, 14)
    prompt = [(3 * t + 1) % 250 for t in range(60)]
    bounded = Engine(MODEL, block_size=4, num_blocks=12, max_num_batched_tokens=8, kv_policy=policy,
                     kv_tiers=[url])
    bounded.generate([prompt], SamplingParams(max_tokens=6, **GREEDY))
    registered = bounded.prefix_cache.num_cached_blocks
    assert 0 < registered <= policy.budget // 4  # only blocks computed before the first eviction
    # a second policy request hits at most below its budget, and still equals the contiguous policy
    recorder = Recorder(bounded)
    [again] = bounded.generate([prompt], SamplingParams(max_tokens=6, **GREEDY))
    assert 0 < again.num_cached_tokens <= policy.budget - 1
    for paged, contiguous in replay(MODEL, policy, recorder.chunks[(again.request_id, 0)],
                                    prompt + again.outputs[0].token_ids):
        assert np.abs(paged - contiguous).max() < 1e-9
    bounded.close(30)
    assert bounded.prefix_cache.num_cached_blocks == registered
    assert bounded.stats()["kv_tier_written_blocks"] == registered
    full = Engine(MODEL, block_size=4, num_blocks=40, kv_tiers=[url])
    recorder = Recorder(full)
    [out] = full.generate([prompt], SamplingParams(max_tokens=3, **GREEDY))
    assert out.num_cached_tokens == registered * 4
    assert full.stats()["kv_tier_hit_blocks"] == registered
    tokens = prompt + out.outputs[0].token_ids
    for start, ids, logits in recorder.chunks[(out.request_id, 0)]:
        if logits is not None:
            reference = MODEL.forward(np.asarray([tokens[:start + len(ids)]])).logits[0, -1]
            assert np.abs(logits - reference).max() < 1e-9
    full.close(30)


def test_a_policy_hit_takes_every_whole_block_below_its_budget():
    """window:9 on blocks of 4: a hit may take 8 rows (budget - 1 = 8 is two whole blocks), so the first chunk
    still evicts nothing; the logits are the contiguous policy's for the same chunks."""
    policy = SlidingWindow(9)
    engine = Engine(MODEL, block_size=4, num_blocks=12, kv_policy=policy)
    prompt = list(range(40, 54))
    assert engine.generate([prompt], SamplingParams(max_tokens=3, **GREEDY))[0].num_cached_tokens == 0
    assert engine.prefix_cache.num_cached_blocks == 2  # blocks 0-1, computed before the first eviction
    recorder = Recorder(engine)
    [again] = engine.generate([prompt], SamplingParams(max_tokens=3, **GREEDY))
    assert again.num_cached_tokens == 8
    chunks = recorder.chunks[(again.request_id, 0)]
    assert chunks[0][0] == 8
    for paged, contiguous in replay(MODEL, policy, chunks, prompt + again.outputs[0].token_ids):
        assert np.abs(paged - contiguous).max() < 1e-9


def test_speculation_keeps_guessing_after_a_context_shift():
    """Once a shift has dropped rows, the rows a sequence may still write before the next eviction count from
    its view (budget - kept rows), not from its whole length: guesses go on, and the tokens stay plain
    decoding's under the same policy."""
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    prompt = [7, 19, 33, 41, 58] * 2
    params = SamplingParams(max_tokens=30, **GREEDY)
    spec = Engine(MODEL, block_size=4, kv_policy="shift:2:14", max_num_batched_tokens=8, speculative_config=ngram)
    spec.add_request("r", prompt, params)
    guessed_after_eviction, tokens = 0, None
    while spec.has_unfinished_requests():
        running = spec.scheduler.running
        evicted = bool(running) and running[0].kv_view is not None and running[0].kv_view.evicted
        before = spec.counters.spec_decode_num_draft_tokens
        for out in spec.step():
            if out.finished:
                tokens = out.outputs[0].token_ids
        if evicted:
            guessed_after_eviction += spec.counters.spec_decode_num_draft_tokens - before
    assert guessed_after_eviction > 0
    plain = Engine(MODEL, block_size=4, kv_policy="shift:2:14", max_num_batched_tokens=8)
    assert tokens == plain.generate([prompt], params)[0].outputs[0].token_ids
    spec.block_pool.check_invariants()
    assert spec.block_pool.num_used_blocks == 0


def test_sink_rows_are_written_only_into_private_blocks():
    """A registered block under the sink rows is copied, never overwritten: its K/V stay full attention's."""
    policy = AttentionSinks(3, 9)
    engine = Engine(MODEL, block_size=4, num_blocks=20, max_num_batched_tokens=4, kv_policy=policy)
    prompt = list(range(40, 80))
    engine.generate([prompt[:8]], SamplingParams(max_tokens=1, **GREEDY))  # registers blocks 0-1
    cached = {b: (engine.block_pool.key_cache[0][b].copy(), engine.prefix_cache.cached_info(b))
              for b in range(engine.block_pool.num_blocks) if engine.prefix_cache.cached_info(b)}
    assert len(cached) == 2
    seen_views = []
    original = engine.bounds.place_sinks

    def place_sinks(seq):
        original(seq)
        if seq.kv_view is not None and seq.kv_view.evicted:
            seen_views.append(seq.kv_view.view_start)
            assert NULL_BLOCK not in seq.block_table[seq.kv_view.view_start // 4:]
    engine.bounds.place_sinks = place_sinks
    engine.generate([prompt], SamplingParams(max_tokens=10, **GREEDY))
    assert seen_views and seen_views == sorted(seen_views)
    for block, (keys, info) in cached.items():
        if engine.prefix_cache.cached_info(block) == info:
            assert np.array_equal(engine.block_pool.key_cache[0][block], keys)


# --- bad settings and bad requests ------------------------------------------------------------------------
@pytest.mark.parametrize("settings_, message", [
    (dict(kv_policy="window:99999"), "context is"),
    (dict(kv_policy="window:40", max_model_len=32), "context is 32"),
    (dict(kv_policy="sinks:8:8"), "larger window"),
    (dict(kv_policy="sinks:9:8"), "larger window"),
    (dict(kv_policy="h2o:4:8"), "H2O .heavy hitters. was removed: attention sinks beat it"),
    (dict(kv_policy=type("EveryOther", (Policy,), dict(budget=6, name="every-other"))()), "prefix plus a tail"),
    (dict(kv_policy="lru:4"), "unknown cache policy"),
    (dict(kv_policy="window:x"), "integer"),
    (dict(kv_policy=5), "policy string"),
    (dict(kv_policy="window:64", block_size=4, num_blocks=10), "holds up to 17 blocks"),
])
def test_bad_policy_settings_are_refused_before_anything_is_allocated(settings_, message):
    with pytest.raises(ConfigError, match=message):
        Engine(MODEL, **settings_)


def test_a_policy_on_a_sliding_window_model_is_refused():
    with pytest.raises(ConfigError, match="sliding-window model"):
        Engine(TinyLlama(seed=1, sliding_window=8), kv_policy="window:16")


def test_bad_requests_leave_a_policy_engine_as_it_was():
    engine = Engine(MODEL, block_size=4, num_blocks=12, max_num_batched_tokens=4, kv_policy="sinks:2:10",
                    max_model_len=64)
    engine.add_request("a", list(range(30)), SamplingParams(max_tokens=8, **GREEDY))
    for _ in range(6):
        engine.step()
    assert engine.scheduler.running[0].kv_view.evicted
    before = json.dumps(engine.cache_state(), sort_keys=True), [k.copy() for k in engine.block_pool.key_cache]
    for call in (lambda: engine.add_request("b", [1, 2, 999]), lambda: engine.add_request("a", [1]),
                 lambda: engine.add_request("b", []), lambda: engine.generate([[1], [1, 999]])):
        with pytest.raises(InputError):
            call()
        assert json.dumps(engine.cache_state(), sort_keys=True) == before[0]
        assert all(np.array_equal(x, y) for x, y in zip(before[1], engine.block_pool.key_cache))
    while engine.has_unfinished_requests():
        engine.step()
    engine.block_pool.check_invariants()
    assert engine.block_pool.num_used_blocks == 0


def test_a_policy_prompt_may_outgrow_max_model_len_but_not_the_pool():
    with pytest.raises(kvlab.errors.ContextLengthError):
        Engine(MODEL, block_size=4, num_blocks=40, max_model_len=32).add_request("a", list(range(100)))
    engine = Engine(MODEL, block_size=4, num_blocks=6, kv_policy="window:16", max_model_len=32)
    [out] = engine.generate([list(range(100))], SamplingParams(max_tokens=3, **GREEDY))
    assert len(out.outputs[0].token_ids) == 3
    assert engine.stats()["num_preemptions"] == 0 and engine.block_pool.num_used_blocks == 0


@pytest.mark.parametrize("policy", ["window:8", "sinks:2:10", "shift:2:10"])
def test_the_numpy_backend_runs_a_policy_as_the_kernels_do(policy):
    """The engine's NumPy attention path (gathering each sequence's blocks) honours a policy's key starts
    and sinks as the compiled kernels do: the same greedy tokens on prompts past the budget."""
    numpy_model = TinyLlama(seed=5, backend="numpy")
    prompts = [[(5 * i + 3 * t) % 250 for t in range(n)] for i, n in enumerate((30, 13))]
    outs = [[o.outputs[0].token_ids for o in Engine(model, block_size=4, num_blocks=24, max_num_batched_tokens=6,
                                                   kv_policy=policy).generate(prompts, SamplingParams(max_tokens=12,
                                                                                                      **GREEDY))]
            for model in (MODEL, numpy_model)]
    assert outs[0] == outs[1]


# --- block bookkeeping seen from the pool -------------------------------------------------------------------
# Cache policies' block bookkeeping in the paged engine (kvlab/engine/kv_bounds.py) seen from the pool: what a
# sequence holds after an eviction (its table's live entries and the sink source: `held_blocks`, which the
# policy tests and the bench measure), and copy-on-write only of blocks that are not the sequence's alone (a
# sink block already private is written in place, never copied again).

ARGMAX = {"ignore_eos": True, "temperature": 0.0}


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
    engine.add_request("a", list(range(40, 70)), SamplingParams(max_tokens=6, **ARGMAX))
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
        engine.generate([prompt[:8]], SamplingParams(max_tokens=1, **ARGMAX))  # registers two blocks
        [out] = engine.generate([prompt], SamplingParams(max_tokens=8, **ARGMAX))
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


def test_bounds_refuse_a_policy_whose_kept_rows_are_not_a_prefix_plus_a_tail() -> None:
    """The engine's config accepts only window, sinks and shift; a policy keeping scattered rows reaching the
    bounds directly is refused by name, before any block changes hands."""
    from types import SimpleNamespace

    from kvlab.cache.paged import BlockPool
    from kvlab.engine.kv_bounds import KVBounds
    from kvlab.prefix.prefix_cache import PrefixCache

    class Scattered:
        budget, max_chunk = 6, 2

        def keep(self, length, num_new):
            return np.array([0, 2, 4, 5])  # row 0, then rows that are not one run up to the end

        def __str__(self) -> str:
            return "scattered"

    pool = BlockPool(1, 1, 2, np.float64, block_size=2, num_blocks=8)
    bounds = KVBounds(pool, PrefixCache(pool), policy=Scattered())
    seq = SimpleNamespace(kv_view=None, num_computed_tokens=6, block_tables=[pool.allocate(3)])
    seq.block_table = seq.block_tables[0]
    with pytest.raises(ValueError) as caught:
        bounds.evict(seq, 2)
    assert str(caught.value) == ("scattered keeps rows that are not a prefix plus a tail: the paged engine "
                                 "cannot place them")
    assert seq.kv_view.prefix == 0 and not seq.kv_view.sink_source
    assert pool.ref_counts[:3] == [1, 1, 1]
