"""The engine on hybrid models (Gemma 2/3: sliding layers beside full ones): a KV-cache group per layer type.

Each group has its own pool; a sliding group gives back the blocks wholly before every future query's window,
so it holds a bounded number of blocks per sequence however long the sequence grows. What must hold: the
tokens are full recompute's (batched, chunked, preempted in tight pools, from the prefix cache), a prefix hit
counts only where the sliding groups hold the window before it (vLLM's rule), the sliding groups stay within
their bound, every pool balances after every run, and a budget that only grouped allocation fits serves a
long request with transformers' greedy tokens.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st

import kvlab
from kvlab import Engine, SamplingParams, TinyLlama
from kvlab.cache.memory import kv_bytes_per_block
from kvlab.engine.kv_bounds import window_max_blocks
from kvlab.errors import ConfigError, KVLabError

S, F = "sliding_attention", "full_attention"
PATTERNS = {"SF": (S, F), "SSF": (S, S, F), "FSS": (F, S, S)}


@lru_cache(maxsize=None)
def hybrid(window: int, pattern: str = "SSF") -> TinyLlama:
    return TinyLlama(seed=4, num_hidden_layers=len(PATTERNS[pattern]), layer_types=PATTERNS[pattern],
                     interleaved_sliding_window=window)


@lru_cache(maxsize=None)
def recompute(model: TinyLlama, prompt: tuple[int, ...], num_new: int) -> list[int]:
    """Greedy tokens by full recompute: the whole sequence through the model, no cache, every step."""
    ids = list(prompt)
    for _ in range(num_new):
        ids.append(int(model.forward([ids]).logits[0, -1].argmax()))
    return ids[len(prompt):]


def check_bounds(engine: Engine) -> None:
    """Every sliding group holds at most its window's bound per sequence; nobody holds a block twice."""
    config = engine.config
    for group in engine.kv_groups[1:]:
        bound = window_max_blocks(config.max_model_len, config.block_size, group.window,
                                  config.max_num_batched_tokens)
        for seq in engine.scheduler.running:
            held = group.held(seq)
            assert len(held) <= bound and len(set(held)) == len(held)


def run(engine: Engine, max_steps: int) -> dict[str, list[list[int]]]:
    """Step to the end (bounded: a livelock fails), checking the bounds each step and the pools at the end;
    every finished request's samples' tokens."""
    done: dict[str, list[list[int]]] = {}
    steps = 0
    while engine.has_unfinished_requests():
        assert steps < max_steps, f"livelock: {engine.scheduler.num_preemptions} preemptions"
        for out in engine.step():
            if out.finished:
                done[out.request_id] = [list(c.token_ids) for c in out.outputs]
                for c in out.outputs:  # short only where the sequence outgrew the whole pool
                    assert c.finish_reason == "length" or c.finish_reason == "stop"
        check_bounds(engine)
        steps += 1
    for group in engine.kv_groups:
        group.pool.check_invariants()
        assert group.pool.num_used_blocks == 0
    return done


def most_blocks_touched(num_tokens: int, block_size: int, window: int | None, max_num_batched_tokens: int) -> int:
    """Brute force: the most blocks a sequence holds in one step, over every step (c rows computed, a chunk of
    n <= max_num_batched_tokens more): from the block of key c - window + 1 (the first its first query sees;
    0 without a window) to the block of row c + n - 1."""
    most = 0
    for computed in range(num_tokens):
        first = max(computed - window + 1, 0) // block_size if window else 0
        for new in range(1, min(max_num_batched_tokens, num_tokens - computed) + 1):
            most = max(most, -(-(computed + new) // block_size) - first)
    return most


def test_window_max_blocks_is_vllms_bound_over_the_blocks_a_window_touches():
    """Against the brute force, on a grid of lengths, block sizes, windows and chunks: every block without a
    window; with one never fewer than a step holds, and one more only where vLLM's cdiv(W - 1 + chunk) + 1
    rounds past it (W - 2 + chunk a multiple of block_size) — exactly there once the sequence is long enough
    for the window to sit at every offset in its blocks."""
    for size in (1, 2, 3, 4):
        for chunk in (1, 2, 3, 5, 8):
            for num_tokens in range(1, 36):
                assert window_max_blocks(num_tokens, size, None, chunk) == -(-num_tokens // size)
                for window in (1, 2, 3, 5, 8):
                    bound = window_max_blocks(num_tokens, size, window, chunk)
                    most = most_blocks_touched(num_tokens, size, window, chunk)
                    rounded_past = (window - 2 + chunk) % size == 0
                    assert most <= bound <= most + rounded_past, (num_tokens, size, window, chunk)
                    if num_tokens >= window + chunk + 2 * size:
                        assert bound == most + rounded_past, (num_tokens, size, window, chunk)


@st.composite
def workloads(draw):
    window = draw(st.sampled_from([1, 2, 3, 5, 8]))
    model = hybrid(window, draw(st.sampled_from(sorted(PATTERNS))))
    settings_ = dict(block_size=draw(st.sampled_from([1, 2, 4, 8])), num_blocks=draw(st.integers(2, 16)),
                     max_num_batched_tokens=draw(st.integers(1, 12)), max_num_seqs=draw(st.integers(1, 4)),
                     enable_prefix_caching=draw(st.booleans()))
    lengths = draw(st.lists(st.integers(1, 30), min_size=1, max_size=4))
    shared = draw(st.booleans())
    prompts = [tuple(range(3, 3 + n)) if shared else tuple((7 * i + 3 * t) % 250 for t in range(n))
               for i, n in enumerate(lengths)]
    params = [SamplingParams(max_tokens=draw(st.integers(1, 12)), n=draw(st.sampled_from([1, 1, 2])),
                             temperature=0, ignore_eos=True) for _ in prompts]
    return model, settings_, prompts, params, draw(st.booleans())


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
@example((hybrid(3), dict(block_size=2, num_blocks=6, max_num_batched_tokens=5, max_num_seqs=3,
                          enable_prefix_caching=True),
          [tuple(range(3, 23)), tuple(range(3, 17)), tuple(range(3, 9))],
          [SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)] * 3, True))
def test_batched_chunked_preempted_and_cached_requests_get_full_recompute_tokens(workload):
    model, settings_, prompts, params, again = workload
    engine = Engine(model, **settings_)
    assert engine.config.hybrid and len(engine.kv_groups) == 2
    for round_ in range(2 if again else 1):
        admitted = {}
        for i, (prompt, param) in enumerate(zip(prompts, params)):
            try:
                engine.add_request(f"r{round_}.{i}", list(prompt), param)
                admitted[f"r{round_}.{i}"] = (prompt, param)
            except KVLabError:
                continue  # refused whole: the pool can never hold it
        work = sum((len(p) + q.max_tokens) * q.n for p, q in admitted.values())
        done = run(engine, max_steps=50 + 10 * work)
        assert set(done) == set(admitted)
        for request_id, (prompt, param) in admitted.items():
            want = recompute(model, prompt, param.max_tokens)
            for tokens in done[request_id]:  # one that outgrew the pool ended early ("length"), on the same path
                assert tokens and tokens == want[:len(tokens)]
                if len(tokens) < param.max_tokens:
                    assert engine.scheduler._too_long(len(prompt) + len(tokens))


def test_batched_equals_alone_equals_recompute_past_the_window():
    model = hybrid(5, "FSS")
    prompts = [tuple((7 * i + 3 * t) % 250 for t in range(n)) for i, n in enumerate([30, 9, 17])]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    batched = Engine(model, block_size=4, max_num_batched_tokens=8, max_num_seqs=4)
    together = [o.outputs[0].token_ids for o in batched.generate([list(p) for p in prompts], params)]
    alone = [Engine(model, block_size=4).generate([list(p)], params)[0].outputs[0].token_ids for p in prompts]
    assert together == alone == [recompute(model, p, 12) for p in prompts]


def test_a_sliding_group_holds_its_window_not_the_sequence():
    """A 160-token sequence on a Gemma-3-shaped model (5 sliding layers of window 8 per full layer): the full
    group holds every block, the sliding group at most window_max_blocks, whatever the length."""
    pattern = (S,) * 5 + (F,)
    model = TinyLlama(seed=4, num_hidden_layers=6, layer_types=pattern, interleaved_sliding_window=8)
    engine = Engine(model, block_size=4, max_num_batched_tokens=8, max_num_seqs=1)
    prompt = [(5 * t) % 250 for t in range(120)]
    engine.add_request("long", prompt, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    full, sliding = engine.kv_groups
    most = [0, 0]
    while engine.has_unfinished_requests():
        engine.step()
        for seq in engine.scheduler.running:
            most = [max(most[0], len(full.held(seq))), max(most[1], len(sliding.held(seq)))]
    assert most[0] == -(-159 // 4)  # the last token's K/V is never computed
    # a chunk of 8 from position c holds the blocks from (c - 7) // 4 to (c + 8) / 4: 4, within the bound of 5
    assert most[1] == 4 <= window_max_blocks(engine.max_model_len, 4, 8, 8) == 5
    # bytes held at the longest point vs every layer keeping every token (the engine before KV-cache groups)
    held = most[0] * full.pool.bytes_per_block + most[1] * sliding.pool.bytes_per_block
    before = most[0] * kv_bytes_per_block(model.config, 4, model.dtype)
    assert held * 3 < before  # 40 x 1 + 5 x 5 layer-blocks against 40 x 6
    for group in engine.kv_groups:
        group.pool.check_invariants()


def test_a_prefix_hit_counts_only_where_the_sliding_window_is_cached():
    """vLLM's rule: the full group has the prompt's blocks, but once the sliding group's blocks under the
    last window were evicted, the hit shrinks to where they are still cached (here: none)."""
    model = hybrid(4, "SF")
    engine = Engine(model, block_size=2, num_blocks=64, max_num_seqs=1, max_num_batched_tokens=4)
    prompt = list(range(3, 23))
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    first = engine.generate([prompt], params)[0]
    assert first.num_cached_tokens == 0
    again = engine.generate([prompt + [7]], params)[0]
    assert again.num_cached_tokens == 20  # both groups cached: a hit up to the last block
    full, sliding = engine.kv_groups
    assert sliding.pool.num_blocks < 20 // 2  # the sliding pool cannot keep the whole prompt
    other = [(11 * t + 1) % 250 for t in range(40)]  # fills the sliding pool: its LRU gives the prompt's back
    engine.generate([other], params)
    assert full.prefix_cache.match(prompt, first_root(engine))[0]  # the full group still has them all
    third = engine.generate([prompt + [7]], params)[0]
    assert third.num_cached_tokens == 0
    for out, tail in ((first, []), (again, [7]), (third, [7])):
        assert out.outputs[0].token_ids == recompute(model, tuple(prompt + tail), 3)
    for group in engine.kv_groups:
        group.pool.check_invariants()


def first_root(engine: Engine) -> bytes:
    from kvlab.prefix.block_hash import root_key

    return root_key(engine.model.fingerprint, engine.model.dtype, engine.kv_cache_dtype)


def test_a_partial_hit_keeps_the_blocks_both_groups_still_hold():
    """Two prompts sharing 16 tokens: the second hits the shared blocks in both groups (the sliding group's
    last window before the hit included) and gives full recompute's tokens."""
    model = hybrid(3, "SSF")
    engine = Engine(model, block_size=4, max_num_seqs=2, max_num_batched_tokens=6)
    shared = list(range(40, 56))
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    engine.generate([shared + [1, 2, 3]], params)
    out = engine.generate([shared + [9, 8, 7, 6, 5]], params)[0]
    assert out.num_cached_tokens == 16
    assert out.outputs[0].token_ids == recompute(model, tuple(shared + [9, 8, 7, 6, 5]), 5)


def test_a_block_count_is_the_full_groups_and_the_sliding_pool_is_sized_per_sequence():
    model = hybrid(5, "SSF")
    config = Engine(model, block_size=4, num_blocks=10, max_num_seqs=3, max_num_batched_tokens=8).config
    full, sliding = config.groups
    assert (full.window, full.layers, full.num_blocks) == (None, (2,), 10)
    per_seq = window_max_blocks(config.max_model_len, 4, 5, 8)
    assert (sliding.window, sliding.layers, sliding.num_blocks) == (5, (0, 1), 3 * per_seq)
    assert sliding.bytes_per_block == 2 * full.bytes_per_block
    # fewer full blocks than sequences: at most that many run at once, each holding one
    assert Engine(model, block_size=4, num_blocks=2, max_num_seqs=3).config.groups[1].num_blocks == \
        2 * window_max_blocks(config.max_model_len, 4, 5, 512)


def test_a_byte_budget_pays_the_sliding_seats_first_then_full_blocks():
    model = hybrid(5, "SSF")
    config = Engine(model, block_size=4, max_num_seqs=2, max_num_batched_tokens=8, kv_cache_memory=50_000).config
    full, sliding = config.groups
    assert sliding.num_blocks == 2 * window_max_blocks(config.max_model_len, 4, 5, 8)
    spent = full.num_blocks * full.bytes_per_block + sliding.num_blocks * sliding.bytes_per_block
    assert spent <= 50_000 < spent + full.bytes_per_block
    with pytest.raises(ConfigError, match="holds no block"):
        Engine(model, block_size=4, max_num_seqs=2, kv_cache_memory=100)


def test_a_budget_only_grouped_allocation_fits_serves_transformers_greedy_tokens(tmp_path):
    """A Gemma 3 checkpoint written by transformers (5 sliding layers of window 6 per full one): a KV budget
    that holds the long request's full-attention blocks plus one sequence's windows, but far from every
    layer's blocks for every token, serves it with transformers' greedy tokens."""
    pytest.importorskip("transformers")
    from family_checkpoints import make_family_checkpoint, transformers_run

    layers = [S, S, S, S, S, F]
    folder = make_family_checkpoint(tmp_path / "g3", "gemma3", num_hidden_layers=6, layer_types=layers)
    model, _ = kvlab.load(folder)
    rng = np.random.default_rng(3)
    prompt = rng.integers(2, 320, size=150).tolist()
    new = 30
    want = transformers_run(folder, np.array([prompt]), new)["tokens"].tolist()
    size, chunk = 8, 16
    full_bytes = kv_bytes_per_block(model.config, size, model.dtype) // 6  # one layer's block
    blocks = -(-(len(prompt) + new) // size)
    budget = blocks * full_bytes + 5 * full_bytes * window_max_blocks(256, size, 6, chunk)
    assert budget < blocks * kv_bytes_per_block(model.config, size, model.dtype) / 3  # all layers would not fit
    engine = Engine(model, block_size=size, kv_cache_memory=budget, max_num_seqs=1, max_num_batched_tokens=chunk)
    assert engine.config.groups[0].num_blocks >= blocks
    engine.add_request("long", prompt, SamplingParams(max_tokens=new, temperature=0, ignore_eos=True))
    got = run(engine, max_steps=200)["long"][0]
    assert got == want
    assert budget // kv_bytes_per_block(model.config, size, model.dtype) < blocks  # one pool: too few blocks


@pytest.mark.parametrize("settings_, reason", [
    (dict(kv_policy="sinks:2:8"), "different windows"),
    (dict(kv_tiers=["file:///tmp/kvlab-hybrid-tier"]), "KV-cache groups"),
])
def test_what_hybrid_models_do_not_run_is_refused_at_construction(settings_, reason):
    with pytest.raises(ConfigError, match=reason):
        Engine(hybrid(5), **settings_)


def test_speculative_decoding_on_a_hybrid_model_gives_the_same_tokens():
    model = hybrid(4, "SSF")
    prompt = [5, 6, 7, 8] * 6
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    engine = Engine(model, block_size=2, max_num_batched_tokens=8, speculative_config=spec)
    out = engine.generate([prompt], params)[0]
    assert out.outputs[0].token_ids == recompute(model, tuple(prompt), 16)
    assert engine.counters.spec_decode_num_draft_tokens > 0
    for group in engine.kv_groups:
        group.pool.check_invariants()
        assert group.pool.num_used_blocks == 0


def test_bytes_per_layer_type_in_stats_cache_state_and_metrics():
    """Each KV-cache group's bytes: in Engine.stats and cache_state (the explorer) and as /metrics gauges
    labelled by group and layer type; a long request's sliding group holds its window, the full one all."""
    import json

    from kvlab.serve.metrics import ServerMetrics

    model = hybrid(4, "SSF")
    engine = Engine(model, block_size=4, max_num_seqs=2, max_num_batched_tokens=8)
    engine.add_request("r", list(range(3, 43)), SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    for _ in range(8):  # the prompt (5 chunks) and a few decodes
        engine.step()
    state = json.loads(json.dumps(engine.cache_state()))
    full, sliding = state["kv_cache_groups"]
    assert (full["layer_type"], full["window"], full["num_layers"]) == ("full_attention", None, 1)
    assert (sliding["layer_type"], sliding["window"], sliding["num_layers"]) == ("sliding_attention", 4, 2)
    [seq] = engine.scheduler.running
    for row, group in zip((full, sliding), engine.kv_groups):
        assert row["num_used_blocks"] == len(group.held(seq))
        assert row["used_bytes"] == row["num_used_blocks"] * group.pool.bytes_per_block
        assert row["capacity_bytes"] == group.pool.capacity_bytes
    assert full["num_used_blocks"] == -(-seq.num_computed_tokens // 4) > sliding["num_used_blocks"]
    # payload: full group every computed row of one layer; sliding group the rows of its held blocks
    per_row = engine.kv_groups[0].pool.bytes_per_block // 4
    assert full["payload_bytes"] == seq.num_computed_tokens * per_row
    assert state["payload_bytes"] == full["payload_bytes"] + sliding["payload_bytes"]
    assert state["capacity_bytes"] == full["capacity_bytes"] + sliding["capacity_bytes"]
    stats = engine.stats()
    assert stats["kv_cache_usage"] == pytest.approx(
        (full["used_bytes"] + sliding["used_bytes"]) / state["capacity_bytes"])
    metrics = ServerMetrics("m")
    metrics.bind(engine.stats)
    text = metrics.render().decode()
    assert (f'kvlab:kv_cache_group_used_bytes{{group="1",layer_type="sliding_attention",model_name="m",'
            f'window="4"}} {float(sliding["used_bytes"])}') in text
    assert f'kvlab:kv_cache_group_used_blocks{{group="0",layer_type="full_attention",model_name="m",window=""}} ' \
           f'{float(full["num_used_blocks"])}' in text


@pytest.mark.parametrize("kv_dtype", ["float16", "int8", "int4", "fp8_e4m3"])
def test_each_groups_pool_allocates_the_bytes_it_was_sized_with(kv_dtype):
    """EngineConfig sizes each group from the kv_spec bytes `kvlab memory` uses; the pools allocate exactly
    those, quantized scales included, and the tokens do not depend on the chunk budget."""
    model = hybrid(3, "SSF")
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    runs = []
    for chunk in (6, 30):
        engine = Engine(model, block_size=4, max_num_seqs=2, max_num_batched_tokens=chunk, kv_cache_dtype=kv_dtype)
        for layout, group in zip(engine.config.groups, engine.kv_groups):
            assert group.pool.bytes_per_block == layout.bytes_per_block
            assert group.pool.capacity_bytes == layout.num_blocks * layout.bytes_per_block
        runs.append(engine.generate([list(range(3, 30))], params)[0].outputs[0].token_ids)
    assert runs[0] == runs[1]
