"""Liveness (docs/ARCHITECTURE.md): every configuration the engine accepts finishes every request it admits,
or is refused at construction; a request alone in the engine always makes progress.

Issue 32: under a context-shift or sinks policy in a tight pool, a lone request preempted itself every other
step forever (the scheduler counted the copy-on-write of its partially filled sink block twice: once as the
sinks' private copy, once as the shared tail's). Each run here is bounded in steps, so a livelock is a failing
example, never a hang.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st

import kvlab
from kvlab import Engine, SamplingParams, TinyLlama
from kvlab.errors import ConfigError, KVLabError
from kvlab.policies import AttentionSinks, ContextShift, SlidingWindow

MODEL = TinyLlama(seed=5)
SLIDING = {window: TinyLlama(seed=2, sliding_window=window) for window in (2, 3, 5, 8, 12)}
# hybrid (Gemma-style sliding layers beside a full one): a KV-cache group, and a pool, per layer type
HYBRID = {window: TinyLlama(seed=2, num_hidden_layers=3, interleaved_sliding_window=window,
                            layer_types=("sliding_attention", "full_attention", "sliding_attention"))
          for window in (1, 2, 3, 5, 8)}


def run_bounded(engine: Engine, max_steps: int) -> int:
    """Step until every request finished; the number of steps. Fails (never hangs) past `max_steps`."""
    steps = 0
    while engine.has_unfinished_requests():
        assert steps < max_steps, (f"livelock: unfinished after {steps} steps, "
                                   f"{engine.scheduler.num_preemptions} preemptions")
        engine.step()
        steps += 1
    for group in engine.kv_groups:
        group.pool.check_invariants()
        assert group.pool.num_used_blocks == 0
    return steps


def policies():
    window = st.integers(2, 24).map(SlidingWindow)
    sinks = st.integers(0, 4).flatmap(lambda s: st.integers(s + 1, 24).map(lambda w: AttentionSinks(s, w)))
    shift = st.integers(0, 4).flatmap(lambda k: st.integers(k + 2, 24).map(lambda b: ContextShift(k, b)))
    return st.one_of(st.none(), window, sinks, shift)


@st.composite
def workloads(draw):
    """A model, an engine configuration (any pool, tight ones included) and a few requests, some sharing a
    prefix, some with n > 1, some sent again once the first round finished (prefix-cache hits)."""
    if draw(st.booleans()) and draw(st.booleans()):
        models = SLIDING if draw(st.booleans()) else HYBRID
        model, policy = models[draw(st.sampled_from(sorted(models)))], None
    else:
        model, policy = MODEL, draw(policies())
    settings_ = dict(block_size=draw(st.sampled_from([1, 2, 4, 8, 16])), num_blocks=draw(st.integers(1, 12)),
                     max_num_batched_tokens=draw(st.integers(1, 24)), max_num_seqs=draw(st.integers(1, 4)),
                     enable_prefix_caching=draw(st.booleans()), kv_policy=policy)
    lengths = draw(st.lists(st.integers(1, 40), min_size=1, max_size=4))
    shared = draw(st.booleans())
    prompts = [list(range(3, 3 + n)) if shared else [(7 * i + 3 * t) % 250 for t in range(n)]
               for i, n in enumerate(lengths)]
    params = [SamplingParams(max_tokens=draw(st.integers(1, 20)), n=draw(st.sampled_from([1, 1, 2])),
                             ignore_eos=True) for _ in prompts]
    again = draw(st.booleans())
    return model, settings_, prompts, params, again


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
# issue 32's reports: a lone 12-token request under shift:1:6 in 3 blocks of 8; sinks 4:11 in 3 blocks of 16
@example((MODEL, dict(block_size=8, num_blocks=3, max_num_batched_tokens=12, max_num_seqs=4,
                      enable_prefix_caching=True, kv_policy=ContextShift(1, 6)),
          [list(range(1, 13))], [SamplingParams(max_tokens=1, ignore_eos=True)], False))
@example((MODEL, dict(block_size=16, num_blocks=3, max_num_batched_tokens=11, max_num_seqs=2,
                      enable_prefix_caching=False, kv_policy=AttentionSinks(4, 11)),
          [[(3 * t) % 250 for t in range(21)]], [SamplingParams(max_tokens=5, ignore_eos=True)], False))
@example((MODEL, dict(block_size=16, num_blocks=3, max_num_batched_tokens=6, max_num_seqs=3,
                      enable_prefix_caching=True, kv_policy=ContextShift(3, 14)),
          [list(range(3, 10)), list(range(3, 37)), list(range(3, 37))],
          [SamplingParams(max_tokens=8, n=2, ignore_eos=True)] * 3, True))
# a hybrid model in a tight pool: forks share the full group's blocks, so more sequences run than the sliding
# pool has seats for and the sliding group preempts too
@example((HYBRID[3], dict(block_size=2, num_blocks=3, max_num_batched_tokens=5, max_num_seqs=4,
                          enable_prefix_caching=True, kv_policy=None),
          [list(range(3, 7)), list(range(3, 9))], [SamplingParams(max_tokens=6, n=2, ignore_eos=True)] * 2, True))
def test_every_accepted_configuration_finishes_every_admitted_request(workload):
    model, settings_, prompts, params, again = workload
    try:
        engine = Engine(model, **settings_)
    except ConfigError:
        return  # refused at construction, with a message (tests/test_engine_policy.py checks the messages)
    rounds = [prompts] + ([[p + [5] for p in prompts]] if again else [])
    for round_, batch in enumerate(rounds):
        admitted = 0
        for i, (prompt, param) in enumerate(zip(batch, params)):
            try:
                engine.add_request(f"r{round_}.{i}", prompt, param)
                admitted += 1
            except KVLabError:
                continue  # refused whole: a prompt the pool can never hold
        work = sum((len(p) + q.max_tokens) * q.n for p, q in zip(batch, params))
        run_bounded(engine, max_steps=50 + 10 * work)


@pytest.mark.parametrize("policy", ["shift:1:6", "shift:1:7", "shift:1:8", "shift:2:7", "shift:2:8", "shift:3:6",
                                    "shift:3:8", "shift:4:7", "sinks:2:6", "sinks:3:5"])
@pytest.mark.parametrize("chunk", [5, 12, 24])
def test_a_lone_request_under_a_tight_policy_finishes(policy, chunk):
    """The configurations issue 32 found livelocked: 3 blocks of 8, one 12-token request."""
    engine = Engine(TinyLlama(seed=5), block_size=8, num_blocks=3, max_num_batched_tokens=chunk,
                    kv_policy=policy)
    engine.add_request("r", list(range(1, 13)), SamplingParams(max_tokens=1))
    run_bounded(engine, max_steps=40)
    assert engine.scheduler.num_preemptions == 0  # alone, it never needs to give its blocks back


def test_the_shipped_model_finishes_a_28_token_prompt_under_shift_1_6():
    """What `kvlab serve --kv-policy shift:1:6 --block-size 8 --num-blocks 3 --max-num-batched-tokens 12` ran
    (the server's engine thread drives this same Engine): no answer, 14,889 preemptions, before the fix."""
    model, tokenizer = kvlab.load()
    engine = Engine(model, tokenizer, block_size=8, num_blocks=3, max_num_batched_tokens=12, kv_policy="shift:1:6")
    prompt = tokenizer.encode("ROMEO: But soft, what light through yonder window breaks? It is the east")
    prompt = (prompt * 2)[:28]
    engine.add_request("r", prompt, SamplingParams(max_tokens=16, ignore_eos=True))
    run_bounded(engine, max_steps=200)
    assert engine.scheduler.num_preemptions == 0


def test_a_sliding_window_prefix_hit_longer_than_the_pool_is_admitted():
    """A sliding-window model whose whole 20-token prompt (5 blocks: the pool) is cached: the next request
    with that prefix took every hit, needed 6 blocks of 5, and waited forever alone. It takes only the blocks
    its window still sees, as vLLM does, and gives full recompute's token."""
    model = TinyLlama(seed=2, sliding_window=6)
    engine = Engine(model, block_size=4, num_blocks=5, max_num_batched_tokens=8)
    prompt = list(range(5, 25))
    engine.add_request("a", prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    run_bounded(engine, max_steps=10)
    engine.add_request("b", prompt + [9], SamplingParams(max_tokens=1, ignore_eos=True))
    outputs = []
    while engine.has_unfinished_requests():
        assert len(outputs) < 10, "livelock: the request was never admitted"
        outputs += engine.step()
    [out] = [o for o in outputs if o.finished]
    assert out.num_cached_tokens == 20
    expected = int(model.forward([prompt + [9]]).logits[0, -1].argmax())
    assert out.outputs[0].token_ids == [expected]
    engine.block_pool.check_invariants()


def test_a_lone_request_that_cannot_get_its_blocks_is_a_clear_error_not_a_livelock() -> None:
    """The scheduler's liveness guard: every configuration the engine accepts serves a lone request, so if
    blocks go missing anyway (here taken from the pool behind the scheduler's back, standing for a bug), the
    request neither preempts itself forever nor waits: the step raises an error that names the sequence,
    the blocks it needs, its KV-cache group and the pool's free and total blocks."""
    engine = Engine(MODEL, block_size=4, num_blocks=8, max_num_batched_tokens=4)
    engine.add_request("lone", list(range(1, 13)), SamplingParams(max_tokens=1))  # 12 tokens, 3 chunks of 4
    engine.step()  # admitted: its first chunk holds one block
    leaked = engine.block_pool.allocate(engine.block_pool.num_free_blocks)
    assert leaked and engine.block_pool.num_free_blocks == 0
    with pytest.raises(RuntimeError, match=r"^liveness: sequence lone#0 alone in the pool needs 1 free blocks "
                                           r"of KV-cache group 0 for 4 tokens but 0 of 8 are free$"):
        engine.step()
