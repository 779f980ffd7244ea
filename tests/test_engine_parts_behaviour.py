"""The engine's parts as a caller sees them: EngineConfig's checks and pool sizing, the model runner's batch,
the scheduler's admission and preemption, the prefix cache's registry. Each test pins a behaviour the
engine's exactness tests (tests/test_engine.py) do not look at directly."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvlab import ByteTokenizer, Engine, SamplingParams, TinyLlama
from kvlab.cache.paged import BlockPool
from kvlab.engine.config import DEFAULT_MAX_KV_BYTES, EngineConfig
from kvlab.errors import ConfigError, InputError
from kvlab.generation.loop import DecodeLoop, StopReason, stop_reason
from kvlab.prefix.block_hash import block_key, root_key
from kvlab.policies.base import Policy
from kvlab.prefix.prefix_cache import PrefixCache

BYTES_PER_BLOCK = 2 * 2 * 2 * 16 * 8 * 8  # K and V, 2 layers, 2 KV heads, 16 positions, head_dim 8, float64


@pytest.fixture(scope="module")
def model():
    return TinyLlama(seed=5)


@pytest.mark.parametrize("settings, named", [
    (dict(block_size=True), "block_size must be a positive int, got bool True"),
    (dict(max_num_seqs=0), "max_num_seqs must be a positive int, got 0"),
    (dict(max_num_batched_tokens=1.5), "max_num_batched_tokens must be a positive int"),
    (dict(max_model_len=0), "max_model_len must be a positive int, got 0"),
    (dict(max_model_len=2049), "max_model_len 2049 exceeds the model's context of 2048 tokens"),
    (dict(enable_prefix_caching="yes"), "enable_prefix_caching must be a bool, got 'yes'"),
    (dict(kv_cache_dtype="int3"), "unsupported KV cache dtype 'int3'"),
    (dict(num_blocks=4, kv_cache_memory="1MiB"), "give num_blocks or kv_cache_memory, not both"),
    (dict(num_blocks=0), "num_blocks must be a positive int, got 0"),
    (dict(kv_cache_memory="lots"), "kv_cache_memory: cannot read kv_cache_memory 'lots' as a byte count"),
    (dict(kv_cache_memory=0), "kv_cache_memory: kv_cache_memory must be a positive int, got 0"),
    (dict(kv_cache_memory="10B"), f"kv_cache_memory '10B' holds no block of {BYTES_PER_BLOCK} bytes"),
])
def test_each_bad_setting_is_named_in_its_error(model, settings, named):
    with pytest.raises(ConfigError) as info:
        EngineConfig.create(model, **settings)
    assert str(info.value).startswith(named)


def test_a_model_that_is_not_a_llama_model_is_refused():
    with pytest.raises(ConfigError, match="^model must be a LlamaModel, got str$"):
        EngineConfig.create("tiny")


def test_settings_are_kept_as_given_and_the_pool_sized_from_them(model):
    config = EngineConfig.create(model, block_size=8, num_blocks=5, max_num_seqs=3, max_num_batched_tokens=7,
                                 enable_prefix_caching=False, kv_cache_dtype="float16", max_model_len=100)
    assert (config.block_size, config.num_blocks, config.max_num_seqs, config.max_num_batched_tokens,
            config.max_model_len, config.enable_prefix_caching) == (8, 5, 3, 7, 100, False)
    assert config.kv_cache_dtype == np.float16 and config.bytes_per_block == 2 * 2 * 2 * 8 * 8 * 2
    assert EngineConfig.create(model).max_model_len == 2048  # the model's context by default
    assert EngineConfig.create(model).enable_prefix_caching is True
    assert EngineConfig.create(model).kv_cache_dtype == np.float64  # the model's dtype by default


def test_default_pool_holds_max_num_seqs_full_contexts_in_whole_blocks_capped(model):
    # 3 sequences of 17 positions in blocks of 16: two blocks each (a partial block is a whole block)
    assert EngineConfig.create(model, max_num_seqs=3, max_model_len=17).num_blocks == 6
    assert EngineConfig.create(model, max_num_seqs=3, max_model_len=16).num_blocks == 3
    assert EngineConfig.create(model, max_num_seqs=1, max_model_len=5).num_blocks == 1
    # enough sequences that the full contexts would pass the cap: the cap, in whole blocks (nothing allocated)
    many = EngineConfig.create(model, max_num_seqs=10_000)
    assert 10_000 * math.ceil(2048 / 16) * BYTES_PER_BLOCK > DEFAULT_MAX_KV_BYTES
    assert many.num_blocks == DEFAULT_MAX_KV_BYTES // BYTES_PER_BLOCK
    # a memory budget buys whole blocks; one byte short of a block buys one block fewer
    assert EngineConfig.create(model, kv_cache_memory=3 * BYTES_PER_BLOCK - 1).num_blocks == 2
    assert EngineConfig.create(model, kv_cache_memory=BYTES_PER_BLOCK).num_blocks == 1


def test_defaults_are_the_servers_and_a_float32_models_pool_is_float32(model):
    """Unset, max_num_seqs and max_num_batched_tokens are 64 and 512 (EngineConfig.create's signature;
    `kvlab serve` defaults its flags alike), and the pool stores the model's compute dtype: a float32
    model's is float32 (a float64 model could not tell, np.dtype(None) being float64 too). A capped
    pool's block count is an int."""
    config = EngineConfig.create(model)
    assert (config.max_num_seqs, config.max_num_batched_tokens) == (64, 512)
    assert EngineConfig.create(TinyLlama(seed=5, dtype=np.float32)).kv_cache_dtype == np.float32
    assert type(EngineConfig.create(model, max_num_seqs=10_000).num_blocks) is int


def test_engine_policy_errors_say_what_runs_instead(model):
    """The whole message, as the server and the CLI print it; a policy as long as max_model_len is
    allowed, one token longer is not (a Policy object: a policy string longer than the context is refused
    earlier, by its parser)."""
    from kvlab.policies.parse import parse_policy

    with pytest.raises(ConfigError) as info:
        EngineConfig.create(model, kv_policy="h2o:4:8")
    assert str(info.value) == ("kv_policy: cache policy 'h2o:4:8': H2O (heavy hitters) was removed: attention sinks "
                               "beat it at the same memory on SmolLM2-135M (README, \"Lossy caches, measured\"); use sinks:S:W")
    scattered = type("Scattered", (Policy,), dict(budget=6, name="scattered"))()
    with pytest.raises(ConfigError) as info:
        EngineConfig.create(model, kv_policy=scattered)
    assert str(info.value) == ("kv_policy scattered cannot run in the paged engine: it must keep a text prefix "
                               "plus a tail, as window:W, sinks:S:W and shift:KEEP[:BUDGET] do "
                               "(kvlab/engine/kv_bounds.py)")
    with pytest.raises(ConfigError) as info:
        EngineConfig.create(TinyLlama(seed=1, sliding_window=8), kv_policy="window:16")
    assert str(info.value) == ("kv_policy window:16 on a sliding-window model (sliding_window 8): the model "
                               "already bounds what it attends to; leave kv_policy unset")
    assert EngineConfig.create(model, kv_policy=parse_policy("window:2048", 4096)).max_model_len == 2048
    with pytest.raises(ConfigError) as info:
        EngineConfig.create(model, kv_policy=parse_policy("window:2049", 4096))
    assert str(info.value) == "kv_policy window:2049 holds 2049 tokens but max_model_len is 2048"


def test_the_engine_allocates_what_its_config_says(model):
    engine = Engine(model, block_size=4, num_blocks=9, max_num_seqs=2, max_num_batched_tokens=5)
    assert engine.block_pool.num_blocks == 9 and engine.block_pool.block_size == 4
    assert engine.config == EngineConfig.create(model, block_size=4, num_blocks=9, max_num_seqs=2,
                                                max_num_batched_tokens=5)


# --- the decode loop (kvlab/generation/loop.py), which the scheduler's stop checks share ---------------------


def test_stop_reasons_read_as_the_cli_prints_them():
    assert [r.value for r in StopReason] == ["eos", "stop string", "max tokens", "context full", "abort",
                                             "interrupted"]
    assert stop_reason(3, 1, (), 1) is StopReason.MAX_TOKENS and stop_reason(3, 1, (), 2) is None
    assert stop_reason(3, 2, (), 9, room=3) is None and stop_reason(3, 3, (), 9, room=3) is StopReason.CONTEXT_FULL


def steps_of(rows, table):
    """A fake model: step k (0 = the prefill) puts all logits mass on table[k][row]."""
    calls = []

    def step(tokens):
        calls.append(None if tokens is None else tokens.copy())
        logits = np.zeros((rows, 16))
        logits[np.arange(rows), table[len(calls) - 1]] = 1.0
        return logits

    return step, calls


def test_a_zero_token_budget_runs_nothing_and_says_why():
    step, calls = steps_of(1, [[5]])
    loop = DecodeLoop(step, lambda logits: logits.argmax(-1), 0, [])
    assert list(loop) == [] and calls == [] and loop.reason is StopReason.MAX_TOKENS
    loop = DecodeLoop(step, lambda logits: logits.argmax(-1), 0, [], room=0)
    assert list(loop) == [] and loop.reason is StopReason.CONTEXT_FULL
    loop = DecodeLoop(step, lambda logits: logits.argmax(-1), 0, [], room=1)  # room left: the limit ended it
    assert list(loop) == [] and loop.reason is StopReason.MAX_TOKENS


def test_one_token_budget_runs_the_prefill_only():
    step, calls = steps_of(1, [[5], [6]])
    loop = DecodeLoop(step, lambda logits: logits.argmax(-1), 1, [9])
    assert [t.tolist() for t in loop] == [[5]] and loop.reason is StopReason.MAX_TOKENS and calls == [None]
    assert loop.num_new == 1


def test_single_yields_ints_and_finished_rows_get_the_default_pad_zero():
    step, _ = steps_of(1, [[5], [6], [7]])
    loop = DecodeLoop(step, lambda logits: logits.argmax(-1), 3, [], single=True)
    tokens = list(loop)
    assert tokens == [5, 6, 7] and all(type(t) is int for t in tokens)
    step, calls = steps_of(2, [[4, 9], [4, 3], [4, 2]])
    loop = DecodeLoop(step, lambda logits: logits.argmax(-1), 3, [4])  # row 0 stops at once
    assert [t.tolist() for t in loop] == [[4, 9], [0, 3], [0, 2]]
    assert loop.reason is StopReason.MAX_TOKENS and loop.num_new == 3
    assert [c.tolist() for c in calls[1:]] == [[[4], [9]], [[0], [3]]]  # fed back as [B, 1], pad included


def test_closing_or_throwing_into_the_loop_ends_it():
    step, calls = steps_of(1, [[5]] * 8)
    loop = DecodeLoop(step, lambda logits: logits.argmax(-1), 8, [])
    assert next(loop).tolist() == [5]
    loop.close()
    with pytest.raises(StopIteration):
        next(loop)
    assert len(calls) == 1  # nothing ran after close: the next token was never fed back
    loop = DecodeLoop(step, lambda logits: logits.argmax(-1), 8, [])
    next(loop)
    with pytest.raises(KeyboardInterrupt):
        loop.throw(KeyboardInterrupt)
    with pytest.raises(StopIteration):  # the exception ended it
        loop.send(None)


# --- the scheduler, watched step by step through the engine's cache_state (the explorer's picture) ----------

KEEP_GOING = dict(ignore_eos=True)


def progress(engine):
    """(request, sample) -> (status, computed tokens, output tokens, block table) of each unfinished one."""
    return {(r["request_id"], r["index"]): (r["status"], r["num_computed_tokens"], r["num_output_tokens"],
                                            r["block_table"]) for r in engine.cache_state()["requests"]}


def test_decodes_go_first_and_prefills_are_chunked_to_the_token_budget(model):
    engine = Engine(model, block_size=4, num_blocks=64, max_num_batched_tokens=5)
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=10, **KEEP_GOING))
    engine.step()
    assert progress(engine) == {("a", 0): ("running", 3, 1, [0])}
    engine.add_request("b", list(range(10, 22)), SamplingParams(max_tokens=10, **KEEP_GOING))
    seen = []
    for _ in range(3):  # a decodes one token per step; b's 12-token prompt gets what is left of the 5
        engine.step()
        seen.append({k: v[:3] for k, v in progress(engine).items()})
    assert seen == [{("a", 0): ("running", 4, 2), ("b", 0): ("running", 4, 0)},
                    {("a", 0): ("running", 5, 3), ("b", 0): ("running", 8, 0)},
                    {("a", 0): ("running", 6, 4), ("b", 0): ("running", 12, 1)}]
    assert progress(engine)[("b", 0)][3] == [1, 3, 4]  # blocks allocated as its chunks needed them
    stats = engine.stats()
    assert (stats["num_computed_tokens"], stats["num_prefill_tokens"], stats["num_generation_tokens"],
            stats["num_prompt_tokens"], stats["num_steps"]) == (18, 15, 5, 15, 4)


def test_max_num_seqs_counts_the_seats_of_a_request_still_to_fork(model):
    engine = Engine(model, block_size=4, num_blocks=64, max_num_seqs=2)
    engine.add_request("pair", [1, 2, 3], SamplingParams(n=2, max_tokens=3, **KEEP_GOING))
    engine.add_request("solo", [4, 5, 6], SamplingParams(max_tokens=3, **KEEP_GOING))
    engine.step()  # "pair" sample 0 holds both seats: "solo" waits, "pair" forks at its first token
    assert {k: v[0] for k, v in progress(engine).items()} == {("pair", 0): "running", ("pair", 1): "running",
                                                           ("solo", 0): "waiting"}
    assert engine.stats()["num_running"] == 1 and engine.stats()["num_waiting"] == 1
    while "pair" in {request for request, _ in progress(engine)}:
        assert progress(engine)[("solo", 0)][0] == "waiting"  # until both samples of "pair" finished
        engine.step()
    engine.step()
    assert progress(engine)[("solo", 0)][0] == "running"


def test_the_newest_running_sequence_is_preempted_and_queued_first(model):
    engine = Engine(model, block_size=2, num_blocks=4, max_num_seqs=2)
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=3, **KEEP_GOING))
    engine.add_request("b", [7, 8, 9], SamplingParams(max_tokens=10, **KEEP_GOING))
    engine.add_request("c", [4, 5, 6], SamplingParams(max_tokens=10, **KEEP_GOING))  # no seat left: waits
    engine.step()
    engine.step()  # 4 tokens each computed, every block in use
    assert progress(engine) == {("a", 0): ("running", 4, 2, [0, 1]), ("b", 0): ("running", 4, 2, [2, 3]),
                                ("c", 0): ("waiting", 0, 0, [])}
    outs = engine.step()  # a needs a third block: b, admitted after it, gives its blocks back; a finishes
    assert [(o.request_id, o.outputs[0].finish_reason) for o in outs] == [("a", "length")]
    assert progress(engine) == {("b", 0): ("waiting", 0, 2, []), ("c", 0): ("waiting", 0, 0, [])}
    assert engine.stats()["num_preemptions"] == 1
    engine.step()  # b is first in line, its 2 tokens kept; c does not fit beside it
    assert progress(engine) == {("b", 0): ("running", 5, 3, [2, 3, 1]), ("c", 0): ("waiting", 0, 0, [])}
    # its first full block (2) was still cached: a hit of 2 tokens (a took its tail block, released first)
    assert engine.stats()["prefix_cache_hits"] == 2 and engine.stats()["prefix_cache_queries"] == 3 + 3 + 5


def test_a_sequence_that_outgrows_the_whole_pool_finishes_with_length(model):
    engine = Engine(model, block_size=2, num_blocks=3)
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=20, **KEEP_GOING))
    outs = [engine.step() for _ in range(5)]
    assert [len(o[0].outputs[0].token_ids) for o in outs] == [1, 2, 3, 4, 4]
    assert outs[-1][0].finished and outs[-1][0].outputs[0].finish_reason == "length"  # 7 tokens need 4 blocks
    assert not engine.has_unfinished_requests() and engine.block_pool.num_used_blocks == 0


# --- the prefix cache's registry, as the engine and the explorer read it -----------------------------------

ROOT = root_key("e" * 64, np.float64, np.float64)


def registry(num_blocks=4, block_size=4):
    pool = BlockPool(1, 1, 2, np.float64, block_size, num_blocks)
    return pool, PrefixCache(pool)


def test_only_a_block_in_use_can_be_registered_and_a_refusal_changes_nothing():
    pool, cache = registry()
    with pytest.raises(InputError, match=r"^block 2 is not in use: only computed blocks can be cached$"):
        cache.register(2, block_key(ROOT, [1, 2, 3, 4]), ROOT, [1, 2, 3, 4])
    assert cache.num_cached_blocks == 0 and cache.lookup(block_key(ROOT, [1, 2, 3, 4])) is None
    [block] = pool.allocate(1)
    assert cache.register(block, block_key(ROOT, [1, 2, 3, 4]), ROOT, np.array([1, 2, 3, 4]))
    info = cache.cached_info(block)
    assert info.token_ids == (1, 2, 3, 4) and all(type(t) is int for t in info.token_ids)
    assert not cache.register(block, block_key(ROOT, [5, 6, 7, 8]), ROOT, [5, 6, 7, 8])  # block taken
    assert cache.lookup(block_key(ROOT, [5, 6, 7, 8])) is None and cache.num_cached_blocks == 1


def test_chains_know_their_parents_and_their_root_while_every_link_is_cached():
    pool, cache = registry(num_blocks=2)
    tokens = list(range(8))
    table = pool.allocate(2)
    keys = cache.insert(table, tokens, ROOT, 8).keys
    first, second = (cache.cached_info(b) for b in table)
    assert (first.parent, second.parent) == (ROOT, keys[0])
    assert cache.chain_parent(first) is None and cache.chain_parent(second) == keys[0]
    assert cache.chain_root(first) == ROOT and cache.chain_root(second) == ROOT
    assert cache.match(tokens, ROOT) == (table, keys)
    pool.release(table)
    assert cache.evictable_blocks() == set(table) and cache.num_evictable == 2
    pool.acquire([table[1]])  # a hit on the second block; the first is the only one the pool can take back
    assert pool.allocate(1) == [table[0]] and cache.cached_info(table[0]) is None
    assert cache.chain_root(second) is None  # a link is gone: the chain hangs from nothing
    assert cache.chain_parent(second) == keys[0]
    assert cache.match(tokens, ROOT) == ([], [])  # the first block is missing: nothing after it is a hit


def test_match_stops_at_a_block_whose_parent_differs():
    pool, cache = registry()
    table = pool.allocate(1)
    other_root = root_key("e" * 64, np.float64, np.float64, "salt")
    key = block_key(ROOT, [1, 2, 3, 4])
    assert cache.register(table[0], key, other_root, [1, 2, 3, 4])  # registered under the wrong parent
    assert cache.match([1, 2, 3, 4, 5], ROOT) == ([], [])


def test_invariant_checks_catch_a_registered_free_block_and_a_referenced_evictable_one():
    pool, cache = registry()
    table = pool.allocate(1)
    cache.insert(table, [1, 2, 3, 4], ROOT, 4)
    cache.check_invariants(set())
    with pytest.raises(AssertionError, match="a free block is still registered"):
        cache.check_invariants({table[0]})
    pool.release(table)
    cache.check_invariants(set())
    pool.ref_counts[table[0]] = 1  # as a bug that forgot to revive it would leave it
    with pytest.raises(AssertionError, match="an evictable block is referenced"):
        cache.check_invariants(set())


def test_a_disabled_prefix_cache_counts_no_queries(model):
    engine = Engine(model, block_size=4, enable_prefix_caching=False)
    engine.generate([list(range(12))] * 2, SamplingParams(max_tokens=2, **KEEP_GOING))
    stats = engine.stats()
    assert stats["prefix_cache_queries"] == stats["prefix_cache_hits"] == 0
    enabled = Engine(model, block_size=4)
    enabled.generate([list(range(12))], SamplingParams(max_tokens=2, **KEEP_GOING))
    enabled.generate([list(range(12))], SamplingParams(max_tokens=2, **KEEP_GOING))
    # the second admission finds 2 whole blocks and 3 rows of the cached tail (the last token is always computed)
    assert (enabled.stats()["prefix_cache_queries"], enabled.stats()["prefix_cache_hits"]) == (24, 11)


def test_a_one_token_prompt_is_a_prefill_and_its_decodes_are_not(model):
    engine = Engine(model, block_size=4)
    engine.add_request("a", [9], SamplingParams(max_tokens=3, **KEEP_GOING))
    engine.step()
    assert (engine.stats()["num_prefill_tokens"], engine.stats()["num_computed_tokens"]) == (1, 1)
    engine.step()
    engine.step()
    assert (engine.stats()["num_prefill_tokens"], engine.stats()["num_computed_tokens"]) == (1, 3)
    assert engine.stats()["num_generation_tokens"] == 3 and not engine.has_unfinished_requests()


def test_every_block_of_a_long_chain_hangs_from_its_root():
    pool, cache = registry(num_blocks=8)
    table = pool.allocate(8)
    cache.insert(table, list(range(32)), ROOT, 32)
    assert [cache.chain_root(cache.cached_info(b)) for b in table] == [ROOT] * 8


def test_a_chain_that_loops_back_on_itself_hangs_from_no_root():
    """A tier (or a bug) may register a block as its own parent: chain_root must stop, not loop forever."""
    pool, cache = registry()
    [block] = pool.allocate(1)
    key = block_key(ROOT, [1, 2, 3, 4])
    assert cache.register(block, key, key, [1, 2, 3, 4])
    cache.insert(pool.allocate(1), [5, 6, 7, 8], ROOT, 4)  # (a root is known)
    assert cache.chain_root(cache.cached_info(block)) is None
    assert cache.chain_parent(cache.cached_info(block)) == key


def streamed(engine, prompt, params):
    """Each step's (token ids, text so far) of one request, and its final output."""
    engine.add_request("r", prompt, params)
    steps = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            steps.append((list(out.outputs[0].token_ids), out.outputs[0].text))
    return steps, out.outputs[0]


def test_stop_strings_spanning_tokens_cut_the_text_at_the_first_one_to_appear(model):
    engine = Engine(model, ByteTokenizer(), block_size=4)
    steps, _ = streamed(engine, "Hello", SamplingParams(max_tokens=16, **KEEP_GOING))
    text = steps[-2][1]  # the text while streaming (the last output also flushes undecodable bytes)
    assert len(text) >= 10
    early, late = text[4:7], text[7:10]  # three characters each, spanning several byte tokens
    _, out = streamed(engine, "Hello", SamplingParams(max_tokens=16, stop=[late, early], **KEEP_GOING))
    # the first step whose text holds either string ends it: that token is kept, the text cut before the match
    first = next(k for k, (_, t) in enumerate(steps) if early in t or late in t)
    ids, seen = steps[first]
    assert out.finish_reason == "stop" and out.token_ids == ids
    assert out.text == seen[:min(i for i in (seen.find(early), seen.find(late)) if i >= 0)]


def test_the_loop_is_a_generator_that_runs_nothing_before_the_first_next():
    step, calls = steps_of(1, [[5], [6]])
    loop = DecodeLoop(step, lambda logits: logits.argmax(-1), 2, [])
    assert loop.reason is None and loop.num_new == 0 and calls == []
    with pytest.raises(TypeError):  # as any generator: nothing can be sent into one that has not started
        loop.send(3)
    loop = DecodeLoop(step, lambda logits: logits.argmax(-1), 2, [])
    assert loop.send(None).tolist() == [5] and loop.reason is None  # send(None) is next()
    assert next(loop).tolist() == [6] and loop.reason is StopReason.MAX_TOKENS


# --- the scheduler's rules on hand-set states (the engine rarely lands exactly on these) -------------------

def scheduler_with(budget: int, num_blocks: int, *seqs: tuple[str, int, int, int]):
    """A Scheduler over a pool of `num_blocks` 4-token blocks, running `seqs` in the order given: each
    (name, num_tokens, num_computed_tokens, admitted_at), holding the blocks its computed tokens fill."""
    from kvlab.engine.request import Request, Status
    from kvlab.engine.scheduler import Scheduler

    pool = BlockPool(1, 1, 2, np.float64, 4, num_blocks)
    scheduler = Scheduler(pool, PrefixCache(pool), max_num_seqs=8, max_num_batched_tokens=budget)
    named = {}
    for name, num_tokens, num_computed, admitted_at in seqs:
        seq = Request(name, list(range(1, num_tokens + 1)), SamplingParams(max_tokens=50), ROOT, 50).seqs[0]
        seq.num_computed_tokens = num_computed
        seq.block_table = pool.allocate(pool.blocks_for(num_computed))
        seq.status, seq.admitted_at = Status.RUNNING, admitted_at
        scheduler.running.append(seq)
        named[name] = seq
    scheduler._admissions = 1 + max((s.admitted_at for s in named.values()), default=-1)
    return scheduler, named


def planned(out) -> list[tuple[str, int]]:
    return [(seq.request.request_id, n) for seq, n in out.scheduled]


def test_decodes_go_before_a_prefill_that_runs_ahead_of_them():
    """A prefill with two tokens left, first in the running list, waits for the decode behind it."""
    scheduler, _ = scheduler_with(2, 8, ("prefill", 10, 8, 0), ("decode", 5, 4, 1))
    assert planned(scheduler.schedule()) == [("decode", 1), ("prefill", 1)]


def test_a_preempted_sequence_is_skipped_and_the_ones_after_it_still_run():
    """`a` needs a third block and none is free: `v`, admitted last, is preempted (its one block freed)
    before its turn; the prefill after it still gets what is left of the budget, no token more."""
    scheduler, seqs = scheduler_with(3, 5, ("a", 9, 8, 0), ("v", 5, 4, 2), ("p", 8, 5, 1))
    assert planned(scheduler.schedule()) == [("a", 1), ("p", 2)]
    assert list(scheduler.waiting) == [seqs["v"]] and seqs["v"].block_table == []
    assert scheduler.num_preemptions == 1 and scheduler.pool.num_free_blocks == 0


def test_a_victim_scheduled_earlier_in_the_step_gives_its_tokens_back():
    """`v` (admitted last) has its decode planned when `a` finds no free block: `v` is preempted and its
    token goes back to the budget, which the prefill after `a` then takes."""
    scheduler, seqs = scheduler_with(3, 6, ("v", 6, 5, 2), ("a", 9, 8, 0), ("p", 8, 6, 1))
    assert planned(scheduler.schedule()) == [("a", 1), ("p", 2)]
    assert list(scheduler.waiting) == [seqs["v"]]


def test_a_sequence_that_preempts_itself_lets_the_rest_run_but_admits_nothing():
    """`v` needs a second block, none is free, and it is the newest: it gives its own block back. The
    prefill after it runs; the freed block and the budget left are not used to admit `v` again in the
    step that preempted (vLLM's rule), and every preemption counts."""
    scheduler, seqs = scheduler_with(4, 3, ("v", 5, 4, 1), ("x", 8, 5, 0))
    assert planned(scheduler.schedule()) == [("x", 3)]
    assert list(scheduler.waiting) == [seqs["v"]] and scheduler.pool.num_free_blocks == 1
    scheduler.preempt(seqs["x"])
    assert scheduler.num_preemptions == 2 and list(scheduler.waiting) == [seqs["x"], seqs["v"]]
    assert scheduler.pool.num_free_blocks == 3



def test_a_suspended_request_can_be_aborted(model):
    """Suspended (out of the waiting queue, status waiting), a request is still aborted cleanly: its
    output says so and the pool is whole (the server aborts a suspended request whose step failed)."""
    engine = Engine(model, block_size=4, num_blocks=16)
    engine.add_request("held", [1, 2, 3, 4, 5], SamplingParams(max_tokens=8, **KEEP_GOING))
    engine.add_request("other", [6, 7, 8], SamplingParams(max_tokens=8, **KEEP_GOING))
    engine.step()
    engine.suspend_request("held")
    assert progress(engine)[("held", 0)][:3] == ("waiting", 0, 1)
    engine.abort_request("held")
    outs = {o.request_id: o for o in engine.step()}
    assert outs["held"].finished and outs["held"].outputs[0].finish_reason == "abort"
    assert not outs["other"].finished and set(progress(engine)) == {("other", 0)}
    engine.abort_request("other")
    assert engine.block_pool.num_used_blocks == 0


@pytest.mark.parametrize("policy, need", [("window:64", 5), ("sinks:4:60", 6), ("shift:4:64", 6),
                                          ("sinks:20:44", 7)])
def test_a_policy_needs_its_budget_one_block_and_its_sink_blocks_in_the_pool(model, policy, need):
    """A policy's sequence holds at most ceil(budget / 16) + 1 blocks of its tail plus ceil(sinks / 16)
    private sink blocks (a shift's n_keep counts as sinks): that many blocks pass, one fewer is refused."""
    assert EngineConfig.create(model, kv_policy=policy, block_size=16, num_blocks=need).num_blocks == need
    with pytest.raises(ConfigError, match=rf"holds up to {need} blocks of 16 tokens at once but the pool has "
                                          rf"{need - 1}"):
        EngineConfig.create(model, kv_policy=policy, block_size=16, num_blocks=need - 1)


def test_a_request_that_ends_inside_a_character_flushes_its_text(model):
    """Byte tokens: three sampled bytes end on the lead byte of a two-byte UTF-8 character. The incremental
    detokenizer holds that byte back while more may follow; when the request finishes it is flushed (as
    the replacement character), so the text equals decoding the ids at once."""
    tokenizer = ByteTokenizer()
    engine = Engine(model, tokenizer, block_size=4, num_blocks=64)
    outs = engine.generate([[1, 2, 3], [200, 201]], SamplingParams(max_tokens=3, temperature=1.0, seed=3,
                                                                   **KEEP_GOING))
    for out in outs:
        [sample] = out.outputs
        assert sample.text == tokenizer.decode(sample.token_ids) and sample.text.endswith("\ufffd")


def test_a_preempted_sequence_shows_in_the_cache_state_of_an_engine_with_a_tier(model, tmp_path):
    """With a K/V tier the explorer's state counts each sequence's tier tokens from its block keys; a
    preempted sequence holds no blocks and no keys, and is listed as waiting with none."""
    engine = Engine(model, block_size=2, num_blocks=4, max_num_seqs=2, kv_tiers=[f"file://{tmp_path}"])
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=3, **KEEP_GOING))
    engine.add_request("b", [7, 8, 9], SamplingParams(max_tokens=10, **KEEP_GOING))
    for _ in range(3):   # the third step preempts b (as in the test above)
        engine.step()
    [b] = [r for r in engine.cache_state()["requests"] if r["request_id"] == "b"]
    assert (b["status"], b["block_table"], b["num_tier_tokens"]) == ("waiting", [], 0)
    assert engine.stats()["num_preemptions"] == 1


def test_a_stop_string_twice_in_one_token_cuts_the_text_at_the_first():
    """The shipped tokenizer's ' possess' holds the stop string 'ss' twice: the text ends before the first."""
    import kvlab
    from kvlab.engine.output_processor import OutputProcessor
    from kvlab.engine.request import Request, Status
    from kvlab.engine.scheduler import Scheduler

    _, tokenizer = kvlab.load()
    [token] = tokenizer.encode(" possess", add_bos=False)
    prompt = tokenizer.encode("ROMEO: I")
    pool = BlockPool(1, 1, 2, np.float64, 4, 8)
    scheduler = Scheduler(pool, PrefixCache(pool), max_num_seqs=1, max_num_batched_tokens=16)
    seq = Request("r", prompt, SamplingParams(max_tokens=5, stop=["ss"]), ROOT, 5).seqs[0]
    seq.num_computed_tokens, seq.block_table = len(prompt), pool.allocate(pool.blocks_for(len(prompt)))
    seq.status, seq.decoder = Status.RUNNING, tokenizer.stream_decoder(prompt)
    scheduler.running.append(seq)
    logits = np.zeros((1, tokenizer.vocab_size))
    logits[0, token] = 1.0   # greedy picks ' possess'
    OutputProcessor(scheduler).process([seq], logits)
    assert (seq.finish_reason, seq.completion().text, seq.output_token_ids) == ("stop", " po", [token])


def test_a_waiting_sequence_too_long_for_the_pool_does_not_hold_up_the_queue():
    """The scheduler alone (the engine refuses such prompts at add_request): a waiting sequence that can
    never fit is removed to finish, and the one behind it is admitted in the same step."""
    from kvlab.engine.request import Request

    scheduler, _ = scheduler_with(16, 3)
    huge = Request("huge", list(range(1, 21)), SamplingParams(max_tokens=5), ROOT, 5).seqs[0]
    small = Request("small", list(range(1, 6)), SamplingParams(max_tokens=5), ROOT, 5).seqs[0]
    scheduler.add(huge)
    scheduler.add(small)
    out = scheduler.schedule()
    assert out.too_long == [huge] and planned(out) == [("small", 5)]


def test_admissions_in_one_step_share_the_token_budget_and_are_numbered_in_order():
    """Three waiting prompts of 10 tokens under a 16-token budget: the first whole, the second chunked to
    the 6 left, the third not at all; each admission numbered after the one before (preemption takes
    the latest)."""
    from kvlab.engine.request import Request

    scheduler, _ = scheduler_with(16, 16)
    seqs = [Request(name, list(range(1, 11)), SamplingParams(max_tokens=5), ROOT, 5).seqs[0] for name in "abc"]
    for seq in seqs:
        scheduler.add(seq)
    assert planned(scheduler.schedule()) == [("a", 10), ("b", 6)]
    scheduler.running.clear()   # as if both ran and finished; admit the third and a fourth next
    later = Request("d", list(range(1, 4)), SamplingParams(max_tokens=5), ROOT, 5).seqs[0]
    scheduler.add(later)
    assert planned(scheduler.schedule()) == [("c", 10), ("d", 3)]
    assert [s.admitted_at for s in seqs + [later]] == [0, 1, 2, 3]


def test_a_sequence_preempted_earlier_in_the_step_is_skipped_and_the_rest_still_run():
    """`a` needs a third block and none is free: `x`, admitted last, is preempted for it; `x` comes next
    in the running list and is skipped, and `c` after it still decodes."""
    scheduler, named = scheduler_with(8, 5, ("a", 9, 8, 0), ("x", 5, 4, 2), ("c", 6, 5, 1))
    out = scheduler.schedule()
    assert planned(out) == [("a", 1), ("c", 1)]
    assert named["x"] in scheduler.waiting and scheduler.num_preemptions == 1


def test_a_fork_copies_its_shared_partial_block_with_exactly_one_more_block():
    """Parent and child share two blocks, the second partly filled; one block is free. The parent's decode
    needs exactly that one (its copy of the shared tail), the child then owns the original: both decode,
    nothing is preempted."""
    from kvlab.engine.request import Request

    scheduler, named = scheduler_with(8, 3, ("p", 7, 6, 0))
    child = Request("c", list(range(1, 8)), SamplingParams(max_tokens=50), ROOT, 50).seqs[0]
    scheduler.fork(named["p"], child)
    out = scheduler.schedule()
    assert planned(out) == [("p", 1), ("c", 1)] and scheduler.num_preemptions == 0
    assert scheduler.pool.num_free_blocks == 0 and named["p"].block_table[0] == child.block_table[0]
    assert named["p"].block_table[1] != child.block_table[1]


def test_a_model_runner_made_without_bounds_runs_a_step_as_a_full_forward(model):
    """The runner's default bounds (no policy, no window): a 5-token prefill computes the full forward's
    last logits, commits its tokens and registers its one full block."""
    from kvlab.engine.counters import StepCounters
    from kvlab.engine.model_runner import ModelRunner
    from kvlab.engine.request import Request

    c = model.config
    pool = BlockPool(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, model.dtype, 4, 8)
    runner = ModelRunner(model, pool, PrefixCache(pool), StepCounters())
    seq = Request("r", [1, 2, 3, 4, 5], SamplingParams(max_tokens=2), ROOT, 2).seqs[0]
    seq.block_table = pool.allocate(2)
    logits, sampled = runner.run([(seq, 5)])
    want = model.forward(np.array([[1, 2, 3, 4, 5]])).logits[0, -1]
    assert sampled == [seq] and np.abs(logits[0] - want).max() <= 1e-12
    assert seq.num_computed_tokens == 5 and len(seq.block_keys) == 1


def test_a_running_sequence_too_long_for_the_pool_ends_and_the_rest_still_run():
    """`big` holds the whole pool and its next token needs a fifth block of four: it is removed to finish,
    and `p`, whose computed prefix sits in a block it shares with `big`, still gets its chunk this step."""
    scheduler, named = scheduler_with(8, 4, ("big", 17, 16, 0))
    from kvlab.engine.request import Request, Status

    p = Request("p", list(range(1, 13)), SamplingParams(max_tokens=5), ROOT, 5).seqs[0]
    p.num_computed_tokens, p.block_table = 4, [named["big"].block_table[0]]
    scheduler.pool.acquire(p.block_table)
    p.status, p.admitted_at = Status.RUNNING, 1
    scheduler.running.append(p)
    out = scheduler.schedule()
    assert out.too_long == [named["big"]] and planned(out) == [("p", 8)]


@pytest.mark.parametrize("stop, text, expected", [
    (["a"], "abcd", ""),         # a stop string at the very start of the text (the window starts at 0)
    (["abc"], "abcd", ""),       # a whole-length stop string that the last token completes from the start
    (["zz", "bc"], "abcd", "a"),  # the longest stop string sets the window; the short one is found in it
    (["cd"], "abcd", "ab"),
])
def test_stop_strings_are_found_wherever_they_start_in_the_text(stop, text, expected):
    """The output stage fed one byte token per step: each step searches only where a stop string could end
    in the new text, which must still find one starting at the text's first character."""
    from kvlab.engine.output_processor import OutputProcessor
    from kvlab.engine.request import Request, Status
    from kvlab.engine.scheduler import Scheduler

    tok = ByteTokenizer()
    prompt = tok.encode("Q:")
    pool = BlockPool(1, 1, 2, np.float64, 4, 8)
    scheduler = Scheduler(pool, PrefixCache(pool), max_num_seqs=1, max_num_batched_tokens=16)
    seq = Request("r", prompt, SamplingParams(max_tokens=8, stop=stop, temperature=0.0), ROOT, 8).seqs[0]
    seq.num_computed_tokens, seq.block_table = len(prompt), pool.allocate(pool.blocks_for(len(prompt)))
    seq.status, seq.decoder = Status.RUNNING, tok.stream_decoder(prompt)
    scheduler.running.append(seq)
    output = OutputProcessor(scheduler)
    fed = []
    for token in tok.encode(text):
        logits = np.zeros((1, tok.vocab_size))
        logits[0, token] = 1.0
        output.process([seq], logits)
        fed.append(token)
        if seq.finished():
            break
    end = next(i for i in range(len(text) + 1) if any(s in text[:i] for s in stop))
    assert seq.finish_reason == "stop" and seq.output_token_ids == fed == tok.encode(text[:end])
    assert seq.completion().text == expected
    assert pool.num_free_blocks == pool.num_blocks
