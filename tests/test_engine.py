"""The engine: a request's tokens do not depend on its company (ARCHITECTURE.md invariant 9), pools balance at
idle, bad input is refused with nothing changed, and the API the server reads behaves as documented."""

import json

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import kvlab
from kvlab import ByteTokenizer, Engine, SamplingParams, TinyLlama, generate
from kvlab.errors import ConfigError, ContextLengthError, InputError

GREEDY = dict(ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return TinyLlama(seed=5)


def reference(model, prompt, max_tokens):
    """Greedy tokens of the prompt alone, with the plain KVCache generate loop."""
    return generate(model, [prompt], max_tokens)[0].tolist()


def run_to_idle(engine, limit=10_000):
    finals = {}
    for _ in range(limit):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert not engine.has_unfinished_requests()
    return finals


def assert_idle_balanced(engine):
    pool = engine.block_pool
    pool.check_invariants()
    assert pool.num_used_blocks == 0 and pool.num_free_blocks == pool.num_blocks
    assert engine.stats()["kv_cache_usage"] == 0.0
    assert engine.stats()["num_running"] == engine.stats()["num_waiting"] == 0


# --- exactness ---------------------------------------------------------------------------------------------
@settings(max_examples=30)
@given(st.data())
def test_random_workloads_give_each_request_its_tokens_alone(data):
    model = TinyLlama(seed=data.draw(st.integers(0, 2)), num_key_value_heads=data.draw(st.sampled_from([1, 2])),
                      sliding_window=data.draw(st.sampled_from([None, None, 7])))
    block_size = data.draw(st.sampled_from([1, 2, 4, 8]))
    stems = [data.draw(st.lists(st.integers(0, 255), min_size=0, max_size=24)) for _ in range(2)]
    requests = []
    for i in range(data.draw(st.integers(1, 6))):
        stem = data.draw(st.sampled_from(stems))
        tail = data.draw(st.lists(st.integers(0, 255), min_size=1, max_size=12))
        requests.append((f"r{i}", stem + tail, data.draw(st.integers(1, 10)), data.draw(st.integers(1, 3)),
                         data.draw(st.integers(0, 12)), data.draw(st.none() | st.integers(0, 16))))
    longest = max(len(p) + m for _, p, m, *_ in requests)
    num_blocks = -(-(longest + 1) // block_size) + data.draw(st.integers(0, 6))  # small: forces preemption
    engine = Engine(model, block_size=block_size, num_blocks=num_blocks,
                    max_num_seqs=data.draw(st.integers(3, 8)),
                    max_num_batched_tokens=data.draw(st.integers(1, 40)),
                    enable_prefix_caching=data.draw(st.booleans()))
    pending = sorted(requests, key=lambda r: r[4])
    step, finals, seen = 0, {}, {}
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][4] <= step:
            rid, prompt, max_tokens, n, _, _ = pending.pop(0)
            engine.add_request(rid, prompt, SamplingParams(n=n, max_tokens=max_tokens, **GREEDY))
        for rid, _, _, _, _, abort_at in requests:
            if abort_at == step and rid in engine._requests:
                engine.abort_request(rid)
        for out in engine.step():
            seen[out.request_id] = out
            if out.finished:
                finals[out.request_id] = out
        state = json.loads(json.dumps(engine.cache_state()))
        refs = {b["id"]: b["ref_count"] for b in state["blocks"]}
        assert sum(r > 0 for r in refs.values()) == state["num_used_blocks"]
        for r in state["requests"]:
            assert all(refs[b] > 0 for b in r["block_table"])
            assert (r["status"] == "waiting") == (r["block_table"] == [] and r["num_computed_tokens"] == 0)
        step += 1
        assert step < 5000
    assert_idle_balanced(engine)
    for rid, prompt, max_tokens, n, _, _ in requests:
        out = finals[rid]
        want = reference(model, prompt, max_tokens)
        assert len(out.outputs) == n and out.prompt_token_ids == prompt
        for sample in out.outputs:
            if sample.finish_reason == "abort":
                assert sample.token_ids == want[:len(sample.token_ids)]
            else:
                assert sample.finish_reason == "length" and sample.token_ids == want
        # token-granular reuse (whole blocks, then a cached tail's rows): any count short of the prompt, and
        # whole blocks only where a sliding window trims what a hit may take
        assert out.num_cached_tokens < len(prompt)
        assert model.config.sliding_window is None or out.num_cached_tokens % block_size == 0
    stats = engine.stats()
    assert stats["prefix_cache_hits"] <= stats["prefix_cache_queries"]


def test_preemption_recomputes_and_hits_the_cache(model):
    prompts = [list(range(10 * i, 10 * i + 12)) for i in range(4)]
    engine = Engine(model, block_size=4, num_blocks=12, max_num_seqs=4)
    outs = engine.generate(prompts, SamplingParams(max_tokens=20, **GREEDY))
    assert engine.stats()["num_preemptions"] > 0
    assert engine.stats()["prefix_cache_hits"] > 0  # re-admission found its own full blocks
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == reference(model, prompt, 20)
        assert out.num_cached_tokens == 0  # reports the first admission
    assert_idle_balanced(engine)


def test_chunked_prefill_and_batching_match_full_recompute_tokens(model):
    prompt = list(range(100, 170))
    want = reference(model, prompt, 8)
    # a recompute of the whole prefix for every step: the cache-free truth
    ids = list(prompt)
    for _ in range(8):
        ids.append(int(np.argmax(model.forward(np.array([ids])).logits[0, -1])))
    assert ids[len(prompt):] == want
    for budget in (1, 7, 64, 512):
        engine = Engine(model, block_size=16, max_num_batched_tokens=budget, num_blocks=64)
        engine.add_request("other", list(range(30)), SamplingParams(max_tokens=5, **GREEDY))
        [out] = engine.generate([prompt], SamplingParams(max_tokens=8, **GREEDY))
        assert out.outputs[0].token_ids == want


def test_shared_48_token_prefix_reports_48_cached_tokens(model):
    rng = np.random.default_rng(0)
    prefix = rng.integers(0, 256, 48).tolist()
    first, second = prefix + [1, 2, 3], prefix + [9, 8, 7, 6]
    cold = reference(model, second, 10)
    engine = Engine(model, block_size=16)
    engine.generate([first], SamplingParams(max_tokens=4, **GREEDY))
    [out] = engine.generate([second], SamplingParams(max_tokens=10, **GREEDY))
    assert out.num_cached_tokens == 48 and out.outputs[0].token_ids == cold
    off = Engine(model, block_size=16, enable_prefix_caching=False)
    off.generate([first], SamplingParams(max_tokens=4, **GREEDY))
    [out] = off.generate([second], SamplingParams(max_tokens=10, **GREEDY))
    assert out.num_cached_tokens == 0 and out.outputs[0].token_ids == cold
    assert off.stats()["prefix_cache_queries"] == 0


def test_hit_rule_whole_blocks_and_last_token_computed(model):
    engine = Engine(model, block_size=4)
    prompt = list(range(12))
    engine.generate([prompt], SamplingParams(max_tokens=2, **GREEDY))
    [again] = engine.generate([prompt], SamplingParams(max_tokens=2, **GREEDY))
    # token-granular: two whole blocks by chain key, then 3 rows of the cached tail (the first run's third
    # block, 12 prompt rows + 1 generated); the last prompt token is always recomputed (its logits are needed)
    assert again.num_cached_tokens == 11
    [longer] = engine.generate([prompt + [1, 2, 3]], SamplingParams(max_tokens=2, **GREEDY))
    assert longer.num_cached_tokens == 12  # the prompt; its next row held the generated token, not 1
    # the generated tokens' full blocks are cached too: the next chat turn repeats the reply and hits them
    reply = engine.generate([list(range(50, 58))], SamplingParams(max_tokens=8, **GREEDY))[0]
    turn2 = list(range(50, 58)) + reply.outputs[0].token_ids[:-1] + [7, 7, 7]
    [hit] = engine.generate([turn2], SamplingParams(max_tokens=1, **GREEDY))
    assert hit.num_cached_tokens == 15  # 8 prompt + 7 reply rows: every row the reply computed


def test_cache_salt_separates_tenants(model):
    engine = Engine(model, block_size=4)
    prompt = list(range(20))
    engine.generate([prompt], SamplingParams(max_tokens=2), cache_salt="alice")
    assert engine.generate([prompt], SamplingParams(max_tokens=2), cache_salt="bob")[0].num_cached_tokens == 0
    assert engine.generate([prompt], SamplingParams(max_tokens=2), cache_salt="alice")[0].num_cached_tokens == 19
    assert engine.generate([prompt], SamplingParams(max_tokens=2))[0].num_cached_tokens == 0


def test_float32_logprobs_match_running_alone():
    model = TinyLlama(seed=2, dtype=np.float32)
    prompts = [list(range(5, 45)), list(range(60, 71)), list(range(5, 25))]
    params = SamplingParams(max_tokens=6, logprobs=3, **GREEDY)
    alone = [Engine(model, block_size=4).generate([p], params)[0] for p in prompts]
    engine = Engine(model, block_size=4, max_num_batched_tokens=9)
    together = engine.generate(prompts, params)
    for a, b in zip(alone, together):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert la.keys() == lb.keys() and len(la) in (3, 4)
            assert max(abs(la[k] - lb[k]) for k in la) < 1e-4


# --- n > 1: forks share blocks, seeds seed + i ------------------------------------------------------------
def test_n_samples_use_seed_plus_i_and_share_the_prompt_blocks(model):
    prompt = list(range(30, 43))  # 13 tokens: the last block is partial, so the forks copy it on write
    params = SamplingParams(temperature=1.0, n=3, seed=11, max_tokens=12, **GREEDY)
    engine = Engine(model, block_size=4, num_blocks=32)
    engine.add_request("fork", prompt, params)
    engine.step()
    shared = engine.block_pool.num_used_blocks
    assert shared == 4 and max(engine.block_pool.ref_counts) == 3  # prompt computed once, held three times
    out = run_to_idle(engine)["fork"]
    for i, sample in enumerate(out.outputs):
        solo = Engine(model, block_size=4).generate(
            [prompt], SamplingParams(temperature=1.0, seed=11 + i, max_tokens=12, **GREEDY))[0]
        assert sample.index == i and sample.token_ids == solo.outputs[0].token_ids
    assert len({tuple(s.token_ids) for s in out.outputs}) > 1
    assert_idle_balanced(engine)


def test_sampling_is_reproducible_under_preemption(model):
    params = SamplingParams(temperature=0.8, top_k=20, seed=3, n=2, max_tokens=15)
    prompts = [list(range(i, i + 9)) for i in range(0, 50, 10)]
    roomy = Engine(model, block_size=4, num_blocks=200).generate(prompts, params)
    tight = Engine(model, block_size=4, num_blocks=10, max_num_batched_tokens=5)
    squeezed = tight.generate(prompts, params)
    assert tight.stats()["num_preemptions"] > 0
    def samples(outputs):
        return [[s.token_ids for s in o.outputs] for o in outputs]
    assert samples(roomy) == samples(squeezed)


# --- the step API ------------------------------------------------------------------------------------------
def test_continuous_batching_abort_and_outputs(model):
    engine = Engine(model, block_size=4, num_blocks=32)
    engine.add_request("a", list(range(10)), SamplingParams(max_tokens=6, **GREEDY))
    first = engine.step()
    assert [o.request_id for o in first] == ["a"] and len(first[0].outputs[0].token_ids) == 1
    engine.add_request("b", list(range(20, 27)), SamplingParams(max_tokens=30, **GREEDY))
    second = engine.step()  # b joins the running batch
    assert {o.request_id for o in second} == {"a", "b"}
    assert engine.stats()["num_running"] == 2
    used = engine.block_pool.num_used_blocks
    engine.abort_request("b")
    assert engine.block_pool.num_used_blocks < used  # freed at once
    with pytest.raises(InputError, match="unknown request_id"):
        engine.abort_request("b")
    engine.add_request("b", [7, 7, 7], SamplingParams(max_tokens=2, **GREEDY))  # the id is free again
    third = engine.step()
    assert [(o.request_id, o.outputs[0].finish_reason) for o in third if o.request_id == "b"] == \
        [("b", "abort"), ("b", None)]
    finals = run_to_idle(engine)
    assert finals["a"].outputs[0].token_ids == reference(model, list(range(10)), 6)
    assert_idle_balanced(engine)


def test_generate_leaves_other_requests_alone(model):
    engine = Engine(model, block_size=4, num_blocks=64)
    engine.add_request("mine", list(range(40, 52)), SamplingParams(max_tokens=3, **GREEDY))
    outs = engine.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=9, **GREEDY))
    assert [o.finished for o in outs] == [True, True]
    assert not engine.has_unfinished_requests()  # "mine" finished while generate stepped the engine ...
    stashed = {o.request_id: o for o in engine.step()}  # ... and its output waits for the caller's step()
    assert set(stashed) == {"mine"} and stashed["mine"].finished
    assert stashed["mine"].outputs[0].token_ids == reference(model, list(range(40, 52)), 3)
    assert engine.step() == []


def test_stop_ids_eos_stop_strings_and_text(model):
    tok = ByteTokenizer()
    engine = Engine(model, tok, block_size=4)
    prompt = "Hello"
    free = engine.generate(prompt, SamplingParams(max_tokens=12, **GREEDY))[0].outputs[0]
    assert free.text == tok.decode(free.token_ids) and free.finish_reason == "length"
    stop_id = free.token_ids[3]
    stopped = engine.generate([prompt], SamplingParams(max_tokens=12, stop_token_ids=[stop_id], **GREEDY))[0]
    cut = free.token_ids.index(stop_id)
    assert stopped.outputs[0].token_ids == free.token_ids[:cut + 1]  # the stop token is kept in token_ids
    assert stopped.outputs[0].text == tok.decode(free.token_ids[:cut])  # and left out of text
    assert stopped.outputs[0].finish_reason == "stop"
    printable = [c for c in free.text if c.isprintable()]
    if len(printable) >= 3:
        target = free.text[free.text.index(printable[2])]
        by_text = engine.generate([prompt], SamplingParams(max_tokens=12, stop=[target], **GREEDY))[0]
        assert by_text.outputs[0].finish_reason == "stop" and target not in by_text.outputs[0].text
        assert free.text.startswith(by_text.outputs[0].text)
    # eos ends a request unless ignore_eos
    eos_model = TinyLlama(seed=5)
    eos = Engine(eos_model, block_size=4)
    first = eos.generate([[1, 2, 3]], SamplingParams(max_tokens=1, **GREEDY))[0].outputs[0].token_ids[0]
    eos.eos_token_ids = frozenset({first})
    out = eos.generate([[1, 2, 3]], SamplingParams(max_tokens=5))[0].outputs[0]
    assert out.token_ids == [first] and out.finish_reason == "stop"


def test_a_sequence_that_outgrows_the_pool_ends_with_length(model):
    engine = Engine(model, block_size=4, num_blocks=3)
    out = engine.generate([list(range(5))], SamplingParams(max_tokens=20, **GREEDY))[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 12 - 5 + 1
    assert out.token_ids == reference(model, list(range(5)), len(out.token_ids))
    assert_idle_balanced(engine)


def test_reset_prefix_cache(model):
    engine = Engine(model, block_size=4)
    engine.generate([list(range(20))], SamplingParams(max_tokens=2))
    assert engine.block_pool.num_evictable_blocks > 0
    engine.add_request("busy", list(range(9)), SamplingParams(max_tokens=3))
    engine.step()
    assert engine.reset_prefix_cache() is False and engine.block_pool.num_evictable_blocks > 0
    run_to_idle(engine)
    assert engine.reset_prefix_cache() is True and engine.block_pool.num_evictable_blocks == 0
    assert engine.generate([list(range(20))], SamplingParams(max_tokens=2))[0].num_cached_tokens == 0


def test_cache_state_is_json_and_consistent(model):
    engine = Engine(model, block_size=4, num_blocks=20)
    engine.generate([list(range(12))], SamplingParams(max_tokens=3))
    engine.add_request("x", list(range(10)), SamplingParams(max_tokens=5, n=2, **GREEDY))
    engine.add_request("y", list(range(50, 90)), SamplingParams(max_tokens=5, **GREEDY))
    engine.step()
    state = json.loads(json.dumps(engine.cache_state()))
    assert state["num_free_blocks"] + state["num_used_blocks"] == state["num_blocks"] == 20
    assert state["num_cached_blocks"] == engine.block_pool.num_evictable_blocks
    by_id = {b["id"]: b for b in state["blocks"]}
    assert sum(1 for b in by_id.values() if b["ref_count"] > 0) == state["num_used_blocks"]
    hashes = {b["hash"] for b in by_id.values() if b["hash"]}
    assert all(b["parent"] is None or b["parent"] in hashes for b in by_id.values())
    statuses = {r["request_id"]: r["status"] for r in state["requests"]}
    assert statuses == {"x": "running", "y": "running"}
    for r in state["requests"]:
        assert all(by_id[b]["ref_count"] > 0 for b in r["block_table"])
        assert len(r["block_table"]) == -(-r["num_computed_tokens"] // 4)
    assert state["payload_bytes"] <= state["capacity_bytes"] and state["stats"]["num_running"] == 2
    x = [r for r in state["requests"] if r["request_id"] == "x"][0]
    assert x["num_cached_tokens"] == 9 and by_id[x["block_table"][0]]["token_ids"] == [0, 1, 2, 3]


# --- budgets and bad input ---------------------------------------------------------------------------------
def test_budget_from_num_blocks_or_memory(model):
    per_block = 2 * 2 * 2 * 16 * 8 * 8  # K+V, layers, H_kv, block, d, float64
    assert Engine(model, kv_cache_memory="64KiB").block_pool.num_blocks == 65536 // per_block
    assert Engine(model, kv_cache_memory=10 * per_block).block_pool.num_blocks == 10
    assert Engine(model, kv_cache_memory="1MB").block_pool.num_blocks == 10**6 // per_block
    assert Engine(model, max_num_seqs=3).block_pool.num_blocks == 3 * 2048 // 16
    half = Engine(model, kv_cache_memory="64KiB", kv_cache_dtype="float16")
    assert half.block_pool.num_blocks == 4 * (65536 // per_block)
    for bad in (dict(num_blocks=4, kv_cache_memory="1MiB"), dict(kv_cache_memory="lots"),
                dict(kv_cache_memory="10B"), dict(num_blocks=0), dict(block_size=True),
                dict(max_num_seqs=0), dict(max_model_len=4096), dict(kv_cache_dtype="int3"),
                dict(enable_prefix_caching="yes"), dict(max_num_batched_tokens=1.5)):
        with pytest.raises(ConfigError):
            Engine(model, **bad)


def snapshot(engine):
    return json.dumps(engine.cache_state(), sort_keys=True), [b.copy() for b in engine.block_pool.key_cache]


def test_every_bad_input_is_refused_with_the_engine_unchanged(model):
    engine = Engine(model, block_size=4, num_blocks=12, max_num_seqs=4, max_model_len=64)
    engine.add_request("a", list(range(10)), SamplingParams(max_tokens=8, **GREEDY))
    engine.add_request("b", list(range(30, 41)), SamplingParams(max_tokens=8, **GREEDY))
    engine.step()
    engine.step()
    before, keys = snapshot(engine)
    bad_calls = [
        (InputError, lambda: engine.add_request("c", [1, 2, 999])),                  # id out of range
        (InputError, lambda: engine.add_request("c", [-1])),
        (InputError, lambda: engine.add_request("c", [])),                           # empty prompt
        (InputError, lambda: engine.add_request("c", [True, 2])),
        (InputError, lambda: engine.add_request("c", [[1, 2]])),
        (InputError, lambda: engine.add_request("c", "text without a tokenizer")),
        (InputError, lambda: engine.add_request("c", [1.5, 2])),
        (ContextLengthError, lambda: engine.add_request("c", list(range(60)), SamplingParams(max_tokens=5))),
        (ContextLengthError, lambda: engine.add_request("c", list(range(64)))),
        (InputError, lambda: engine.add_request("a", [1, 2])),                       # duplicate request_id
        (InputError, lambda: engine.add_request("c", [1], SamplingParams(n=0))),     # n < 1
        (InputError, lambda: engine.add_request("c", [1], SamplingParams(n=5))),     # n > max_num_seqs
        (InputError, lambda: engine.add_request("c", list(range(48)), SamplingParams(max_tokens=1))),  # pool
        (InputError, lambda: engine.add_request("c", [1], {"max_tokens": 3})),
        (InputError, lambda: engine.add_request("c", [1], SamplingParams(stop=["x"]))),
        (InputError, lambda: engine.add_request(7, [1])),
        (InputError, lambda: engine.add_request("c", [1], cache_salt=5)),
        (InputError, lambda: engine.abort_request("nobody")),                        # unknown request
        (InputError, lambda: engine.generate([[1, 2], [1, 999]])),                   # one bad prompt: none run
        (InputError, lambda: engine.generate([[1, 2]], [SamplingParams(), SamplingParams()])),
        (InputError, lambda: engine.generate([])),
    ]
    for error, call in bad_calls:
        with pytest.raises(error):
            call()
        after, keys_after = snapshot(engine)
        assert after == before
        assert all(np.array_equal(x, y) for x, y in zip(keys, keys_after))
    finals = run_to_idle(engine)
    assert set(finals) == {"a", "b"}
    assert finals["a"].outputs[0].token_ids == reference(model, list(range(10)), 8)
    assert finals["b"].outputs[0].token_ids == reference(model, list(range(30, 41)), 8)
    assert_idle_balanced(engine)


def test_engine_is_exported_and_runs_the_default_model():
    model, tok = kvlab.load()
    engine = kvlab.Engine(model, tok, max_num_seqs=4)
    outs = engine.generate(["ROMEO:", "JULIET:"], SamplingParams(max_tokens=8))
    ids = tok.encode("ROMEO:")
    assert outs[0].outputs[0].token_ids == generate(model, [ids], len(outs[0].outputs[0].token_ids),
                                                    stop_token_ids=tok.eos_token_ids)[0].tolist()
    assert isinstance(outs[1].outputs[0].text, str) and outs[1].prompt_token_ids == tok.encode("JULIET:")


@settings(max_examples=12)
@given(st.data())
def test_seeded_sampling_does_not_depend_on_company(data):
    model = TinyLlama(seed=1)
    count = data.draw(st.integers(1, 4))
    prompts = [data.draw(st.lists(st.integers(0, 255), min_size=1, max_size=20)) for _ in range(count)]
    params = [SamplingParams(temperature=data.draw(st.sampled_from([0.0, 0.7, 1.3])), top_p=0.9, seed=i,
                             n=data.draw(st.integers(1, 3)), max_tokens=data.draw(st.integers(1, 12)),
                             ignore_eos=True) for i in range(len(prompts))]
    alone = [Engine(model, block_size=4).generate([p], q)[0] for p, q in zip(prompts, params)]
    longest = max(len(p) + q.max_tokens for p, q in zip(prompts, params))
    engine = Engine(model, block_size=data.draw(st.sampled_from([2, 4])), num_blocks=-(-(longest + 1) // 2) + 2,
                    max_num_batched_tokens=data.draw(st.integers(1, 16)))
    together = engine.generate(prompts, params)
    for a, b in zip(alone, together):
        assert [s.token_ids for s in a.outputs] == [s.token_ids for s in b.outputs]
    assert_idle_balanced(engine)


def test_low_precision_pool_runs_close_to_exact():
    model = TinyLlama(seed=4, dtype=np.float32)
    prompts = [list(range(3, 30)), list(range(40, 52))]
    params = SamplingParams(max_tokens=6, logprobs=5, **GREEDY)
    exact = Engine(model, block_size=4).generate(prompts, params)
    for dtype in ("float16", "bfloat16"):
        engine = Engine(model, block_size=4, kv_cache_dtype=dtype)
        assert engine.block_pool.key_cache[0].dtype.name == dtype
        low = engine.generate(prompts, params)
        for a, b in zip(exact, low):
            first_a, first_b = a.outputs[0].logprobs[0], b.outputs[0].logprobs[0]
            token = a.outputs[0].token_ids[0]
            assert token in first_b and abs(first_a[token] - first_b[token]) < 0.05  # a measured, bounded error


def test_a_hit_covers_every_full_block_before_the_last_token(model):
    """A prompt one token past a cached block boundary hits all of its full blocks: only the last token
    is recomputed (12 + 1 tokens over blocks of 4: 12 cached)."""
    engine = Engine(model, block_size=4)
    prompt = list(range(12))
    engine.generate([prompt + [40, 41]], SamplingParams(max_tokens=1, **GREEDY))
    [one_more] = engine.generate([prompt + [40]], SamplingParams(max_tokens=2, **GREEDY))
    assert one_more.num_cached_tokens == 12
    assert one_more.outputs[0].token_ids == reference(model, prompt + [40], 2)

