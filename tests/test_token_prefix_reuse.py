"""Token-granular prefix reuse in the engine: a request reuses every row an earlier one computed for the
tokens they share (whole blocks by chain key, then the rows of a cached tail or of a full block it parts
from, copied into a private block), and what it computes stays exact.

Why it matters: `kvlab chat` and `--prompt-cache` run on the engine, and a conversation's next turn must
reuse every row of the last one, as the contiguous session did, not only its whole blocks."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from kvlab import TinyLlama
from kvlab.cache.kv_cache import KVCache
from kvlab.engine.engine import Engine
from kvlab.errors import CacheMismatchError, InputError
from kvlab.sessions.session_io import load_session, read_session, register_session, save_session
from kvlab.sampling.sampler import SamplingParams
from kvlab.sessions.persist import read_session_file, write_session_file

MODEL = TinyLlama(seed=7)  # float64
GREEDY = dict(temperature=0.0, ignore_eos=True)


def shared(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def cold(prompt: list[int], max_tokens: int) -> list[int]:
    """The same request on an engine without prefix caching (everything computed)."""
    engine = Engine(MODEL, max_num_seqs=1, block_size=4, num_blocks=64, enable_prefix_caching=False)
    return engine.generate([prompt], SamplingParams(max_tokens=max_tokens, **GREEDY))[0].outputs[0].token_ids


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_each_request_reuses_every_row_it_shares_with_an_earlier_one(data: st.DataObject) -> None:
    block_size = data.draw(st.sampled_from([2, 4, 8]), label="block_size")
    engine = Engine(MODEL, max_num_seqs=1, block_size=block_size, num_blocks=400 // block_size,
                    enable_prefix_caching=True)
    base = data.draw(st.lists(st.integers(3, 255), min_size=30, max_size=30), label="base")
    seen: list[list[int]] = []  # every earlier request's rows with K/V: prompt + output[:-1]
    for i in range(data.draw(st.integers(2, 5), label="requests")):
        cut = data.draw(st.integers(1, 30), label="cut")
        prompt = base[:cut] + data.draw(st.lists(st.integers(3, 255), max_size=6), label="tail")
        max_tokens = data.draw(st.integers(1, 5), label="max_tokens")
        out = engine.generate([prompt], SamplingParams(max_tokens=max_tokens, **GREEDY))[0]
        expected = min(max((shared(prompt, rows) for rows in seen), default=0), len(prompt) - 1)
        assert out.num_cached_tokens == expected, (prompt, seen)
        assert out.outputs[0].token_ids == cold(prompt, max_tokens)
        seen.append(prompt + out.outputs[0].token_ids[:-1])
        engine.block_pool.check_invariants()


def test_a_small_pool_evicts_tails_and_stays_balanced() -> None:
    """Tails are evictable like any cached block: a pool that cannot hold them all evicts the oldest."""
    engine = Engine(MODEL, max_num_seqs=2, block_size=4, num_blocks=12, enable_prefix_caching=True)
    rng = np.random.default_rng(0)
    for i in range(30):
        prompt = [int(t) for t in rng.integers(3, 255, size=int(rng.integers(2, 14)))]
        engine.generate([prompt, prompt[:-1] or prompt], SamplingParams(max_tokens=3, **GREEDY))
        engine.block_pool.check_invariants()
    assert engine.block_pool.num_used_blocks == 0


def test_session_files_round_trip_through_the_prefix_cache_exactly(tmp_path) -> None:
    """save_session writes the rows the engine computed (whole blocks and the tail) equal to a contiguous
    forward's; load_session into a fresh engine makes the next request reuse all of them."""
    prompt = list(range(3, 29))  # 26 tokens: 6 blocks of 4 and a tail of 2
    engine = Engine(MODEL, max_num_seqs=1, block_size=4, num_blocks=32, enable_prefix_caching=True)
    out = engine.generate([prompt], SamplingParams(max_tokens=4, **GREEDY))[0].outputs[0].token_ids
    rows = prompt + out[:-1]
    assert save_session(engine, tmp_path / "s.kvc", rows, {"note": "x"}) == len(rows)

    cache = MODEL.new_cache(1)
    MODEL.forward(np.array([rows]), cache=cache, use_cache=True)
    fresh = Engine(MODEL, max_num_seqs=1, block_size=4, num_blocks=32, enable_prefix_caching=True)
    saved, cached = load_session(fresh, tmp_path / "s.kvc")
    assert cached == len(rows) and saved.extra == {"note": "x"}
    for layer, (k, v) in enumerate(saved.cache):
        ref_k, ref_v = cache[layer]
        assert np.max(np.abs(k - ref_k)) <= 1e-12 and np.max(np.abs(v - ref_v)) <= 1e-12
    again = fresh.generate([rows + [7]], SamplingParams(max_tokens=3, **GREEDY))[0]
    assert again.num_cached_tokens == len(rows)
    assert again.outputs[0].token_ids == cold(rows + [7], 3)
    fresh.block_pool.check_invariants()


# --- session files: the cases the round trip does not reach -------------------------------------------------
# Session files in and out of the engine's prefix cache (kvlab/sessions/session_io.py), the cases the round
# trip in test_token_prefix_reuse.py does not reach: engines that cannot hold a session (hybrid groups, a
# quantized pool) and what they say, another cache dtype, a shifted cache, a sub-block session, a whole-block
# session, a session saved from blocks that are not the pool's first ones, an empty save, caching off, and a
# reload into a pool full of other cached blocks (nothing of theirs is evicted for blocks already held).

def new_engine(model=MODEL, **kwargs) -> Engine:
    settings = {"max_num_seqs": 1, "block_size": 4, "num_blocks": 32, "enable_prefix_caching": True}
    return Engine(model, **{**settings, **kwargs})


def computed_rows(eng: Engine, prompt: list[int], max_tokens: int) -> list[int]:
    """Run `prompt`; the tokens whose K/V the engine computed (prompt + output[:-1])."""
    out = eng.generate([prompt], SamplingParams(max_tokens=max_tokens, **GREEDY))[0].outputs[0].token_ids
    return prompt + out[:-1]


def contiguous(model: TinyLlama, rows: list[int]) -> KVCache:
    cache = model.new_cache(1)
    model.forward(np.array([rows]), cache=cache, use_cache=True)
    return cache


def assert_rows_equal(saved: KVCache, reference: KVCache, tol: float = 1e-12) -> None:
    for (k, v), (ref_k, ref_v) in zip(saved, reference):
        assert k.shape == ref_k.shape and v.shape == ref_v.shape
        assert np.max(np.abs(k - ref_k)) <= tol and np.max(np.abs(v - ref_v)) <= tol


def test_a_hybrid_engine_refuses_session_files_and_says_why(tmp_path) -> None:
    """Two KV-cache groups (one sliding layer, one full) already have no single block table to save."""
    hybrid = TinyLlama(seed=4, num_hidden_layers=2, layer_types=("sliding_attention", "full_attention"),
                       interleaved_sliding_window=4)
    eng = new_engine(hybrid)
    assert len(eng.kv_groups) == 2
    for doing, call in (("save", lambda: save_session(eng, tmp_path / "h.kvc", [3, 4, 5], {})),
                        ("load", lambda: read_session(eng, tmp_path / "missing.kvc"))):
        with pytest.raises(InputError) as caught:
            call()
        assert str(caught.value) == (f"cannot {doing} a session file on this model: its layer types keep "
                                     "KV-cache groups of their own (sliding layers hold only their window)")
    assert not (tmp_path / "h.kvc").exists()


def test_a_quantized_pool_refuses_session_files_and_says_why(tmp_path) -> None:
    eng = new_engine(kv_cache_dtype="int8")
    for doing, call in (("save", lambda: save_session(eng, tmp_path / "q.kvc", [3, 4, 5], {})),
                        ("load", lambda: load_session(eng, tmp_path / "missing.kvc"))):
        with pytest.raises(InputError) as caught:
            call()
        assert str(caught.value) == (f"session files hold float K/V rows; a {eng.kv_cache_dtype} cache cannot "
                                     f"{doing} them (use a float cache dtype for sessions and prompt caches)")


def test_a_float32_engine_saves_and_reloads_under_its_own_chain_root(tmp_path) -> None:
    """The chain root names the model's compute dtype and the cache dtype: a float32 model's session is found
    by the keys its requests compute (a float64 root would find nothing and save nothing)."""
    model = TinyLlama(seed=3, dtype=np.float32)
    first = new_engine(model)
    rows = computed_rows(first, list(range(3, 17)), 3)  # 16 rows: 4 whole blocks
    assert save_session(first, tmp_path / "f32.kvc", rows, {}) == len(rows)
    fresh = new_engine(model)
    _, cached = load_session(fresh, tmp_path / "f32.kvc")
    assert cached == len(rows)
    again = fresh.generate([rows + [9]], SamplingParams(max_tokens=1, **GREEDY))[0]
    assert again.num_cached_tokens == len(rows)


def test_a_file_of_another_cache_dtype_is_refused(tmp_path) -> None:
    eng32 = new_engine(kv_cache_dtype="float32")
    rows = computed_rows(eng32, list(range(3, 15)), 2)
    assert save_session(eng32, tmp_path / "kv32.kvc", rows, {}) == len(rows)
    eng64 = new_engine()
    with pytest.raises(CacheMismatchError, match="holds float32 rows"):
        load_session(eng64, tmp_path / "kv32.kvc")
    assert eng64.prefix_cache.num_cached_blocks == 0


def test_a_shifted_cache_cannot_seed_a_prefix(tmp_path) -> None:
    rows = list(range(3, 9))
    cache = contiguous(MODEL, rows)
    keys = [k for k, _ in cache]
    values = [v for _, v in cache]
    shifted = KVCache.from_arrays(MODEL.cache_spec, keys, values, np.arange(1, len(rows) + 1, dtype=np.int64))
    write_session_file(tmp_path / "shifted.kvc", shifted, rows, {})
    eng = new_engine()
    with pytest.raises(InputError) as caught:
        read_session(eng, tmp_path / "shifted.kvc")
    assert str(caught.value) == (f"{tmp_path / 'shifted.kvc'}: its rows are not at positions 0..5 (a shifted "
                                 "cache): it cannot seed a prefix")


def test_a_session_shorter_than_a_block_round_trips(tmp_path) -> None:
    """Three rows, no whole block: saved from the cached tail alone, loaded as a tail under the root."""
    eng = new_engine()
    rows = computed_rows(eng, [11, 12, 13], 1)
    assert save_session(eng, tmp_path / "short.kvc", rows, {}) == 3
    saved = read_session_file(tmp_path / "short.kvc", MODEL)
    assert_rows_equal(saved.cache, contiguous(MODEL, rows))
    fresh = new_engine()
    _, cached = load_session(fresh, tmp_path / "short.kvc")
    assert cached == 3
    again = fresh.generate([rows + [7, 8]], SamplingParams(max_tokens=1, **GREEDY))[0]
    assert again.num_cached_tokens == 3
    fresh.block_pool.check_invariants()


def test_a_whole_block_session_reports_its_rows_and_caches_no_tail(tmp_path) -> None:
    eng = new_engine()
    rows = computed_rows(eng, list(range(20, 28)), 1)  # 8 rows: 2 whole blocks of 4
    assert save_session(eng, tmp_path / "whole.kvc", rows, {}) == 8
    fresh = new_engine()
    cached = load_session(fresh, tmp_path / "whole.kvc")[1]
    assert cached == 8 and isinstance(cached, int)
    assert fresh.prefix_cache.num_cached_blocks == 2
    hits, keys = fresh.prefix_cache.match(rows, _root_of(fresh))
    assert len(hits) == 2 and fresh.prefix_cache.match_tail(rows + [1], keys[-1], 8) is None
    fresh.block_pool.check_invariants()


def _root_of(eng: Engine) -> bytes:
    from kvlab.prefix.block_hash import root_key
    return root_key(eng.model.fingerprint, eng.model.dtype, eng.kv_cache_dtype)


def test_loading_a_session_whose_rows_are_all_cached_reports_them_all(tmp_path) -> None:
    """Loading into the engine that computed the rows (whole blocks and the tail cached already) reports every
    row as cached, as the next request finds them, and allocates nothing."""
    eng = new_engine()
    rows = computed_rows(eng, list(range(50, 60)), 1)  # 2 whole blocks of 4 and a tail of 2 (or 3) rows
    assert save_session(eng, tmp_path / "all.kvc", rows, {}) == len(rows)
    free = eng.block_pool.num_free_blocks
    _, cached = load_session(eng, tmp_path / "all.kvc")
    assert cached == len(rows) and eng.block_pool.num_free_blocks == free
    assert eng.generate([rows + [7]], SamplingParams(max_tokens=1, **GREEDY))[0].num_cached_tokens == len(rows)
    eng.block_pool.check_invariants()


def test_rows_saved_from_later_blocks_are_the_sequences_own(tmp_path) -> None:
    """The second request's blocks are not the pool's first ones: the file holds its rows, not block 0's."""
    eng = new_engine()
    computed_rows(eng, [200 + i for i in range(10)], 2)  # takes the first blocks, then stays cached
    rows = computed_rows(eng, list(range(3, 17)), 3)
    assert save_session(eng, tmp_path / "later.kvc", rows, {}) == len(rows)
    saved = read_session_file(tmp_path / "later.kvc", MODEL)
    assert_rows_equal(saved.cache, contiguous(MODEL, rows))


def test_loaded_rows_are_written_where_the_cache_finds_them(tmp_path) -> None:
    """Load a file into an engine whose first blocks hold something else, then save the same tokens back: the
    rows read back from the pool are the file's (every row, tail included), so nothing was left unwritten."""
    source = new_engine()
    rows = computed_rows(source, list(range(30, 44)), 4)  # 17 rows: 4 blocks and a tail of 1
    assert save_session(source, tmp_path / "a.kvc", rows, {}) == len(rows)
    target = new_engine()
    computed_rows(target, [100 + i for i in range(9)], 2)
    _, cached = load_session(target, tmp_path / "a.kvc")
    assert cached == len(rows)
    assert save_session(target, tmp_path / "b.kvc", rows, {}) == len(rows)
    assert_rows_equal(read_session_file(tmp_path / "b.kvc", MODEL).cache,
                      read_session_file(tmp_path / "a.kvc", MODEL).cache, tol=0.0)


def test_a_reload_keeps_what_the_pool_already_holds_and_evicts_nothing_else(tmp_path) -> None:
    """Reloading a whole-block session the cache already holds allocates nothing: the other cached blocks of
    a full pool stay cached (a spare allocation would evict the least recently used of them)."""
    eng = new_engine(num_blocks=10)
    rows = computed_rows(eng, list(range(40, 48)), 1)  # 2 whole blocks
    assert save_session(eng, tmp_path / "w.kvc", rows, {}) == 8
    fresh = new_engine(num_blocks=10)
    assert load_session(fresh, tmp_path / "w.kvc")[1] == 8
    other = computed_rows(fresh, [150 + i for i in range(32)], 1)  # fills the rest of the pool with cached blocks
    assert fresh.block_pool.num_free_blocks == fresh.block_pool.num_evictable_blocks  # nothing plainly free
    before = fresh.prefix_cache.num_cached_blocks
    assert load_session(fresh, tmp_path / "w.kvc")[1] == 8
    assert fresh.prefix_cache.num_cached_blocks == before
    assert fresh.generate([other + [1]], SamplingParams(max_tokens=1, **GREEDY))[0].num_cached_tokens \
        == len(other) // 4 * 4
    fresh.block_pool.check_invariants()


def test_caching_off_registers_nothing_and_says_so(tmp_path) -> None:
    eng = new_engine()
    rows = computed_rows(eng, list(range(3, 13)), 2)
    assert save_session(eng, tmp_path / "s.kvc", rows, {}) == len(rows)
    off = new_engine(enable_prefix_caching=False)
    saved, cached = load_session(off, tmp_path / "s.kvc")
    assert cached == 0 and saved.tokens == rows
    assert off.block_pool.num_used_blocks == 0


def test_saving_tokens_nothing_caches_writes_an_empty_session(tmp_path) -> None:
    eng = new_engine()
    assert save_session(eng, tmp_path / "empty.kvc", [5, 6, 7, 8, 9], {"k": 1}) == 0
    saved = read_session_file(tmp_path / "empty.kvc", MODEL)
    assert saved.tokens == [] and saved.extra == {"k": 1}
    assert register_session(new_engine(), saved) == 0


def test_loading_keeps_the_rows_the_cache_already_holds(tmp_path) -> None:
    """A file whose whole blocks the cache already holds writes only the rows after them: the cached blocks
    (maybe read by running requests) keep their own K/V, even where the file's differ."""
    eng = new_engine()
    rows = computed_rows(eng, list(range(50, 58)), 1)  # 8 rows: 2 whole blocks
    cache = contiguous(MODEL, rows)
    keys = [k + 1.0 for k, _ in cache]  # the file's rows differ from the engine's everywhere
    values = [v + 1.0 for _, v in cache]
    write_session_file(tmp_path / "other.kvc", KVCache.from_arrays(MODEL.cache_spec, keys, values,
                                                                   np.arange(len(rows), dtype=np.int64)), rows, {})
    hits, _ = eng.prefix_cache.match(rows, _root_of(eng))
    held = [eng.block_pool.key_cache[0][b].copy() for b in hits]
    assert len(hits) == 2
    assert load_session(eng, tmp_path / "other.kvc")[1] == len(rows)
    for block, before in zip(hits, held):
        np.testing.assert_array_equal(eng.block_pool.key_cache[0][block], before)


# --- the scheduler's side of tails: fit, LRU, which engines keep them -----------------------------------------
# Boundary cases of kvlab/engine/scheduler.py's token-granular reuse: a pool with exactly the blocks a tail's
# copy takes, a prompt ending one token past its whole-block hit (no tail row can be copied: the last token is
# always computed), engines that keep no tails (a window, a policy, KV-cache groups), blocks of one token.

def test_a_tail_copy_needs_one_free_block_for_the_held_tail_and_no_more() -> None:
    """A cached tail is held (out of the LRU) while it is copied: with 3 blocks the request copies its 2 rows
    (the whole block and the tail revived, one new block), with 2 it recomputes them; tokens are exact."""
    first, second = [11, 12, 13, 14, 15, 16], [11, 12, 13, 14, 15, 16, 17]
    for num_blocks, cached in ((3, 6), (2, 4)):
        engine = new_engine(num_blocks=num_blocks)
        assert engine.generate([first], SamplingParams(max_tokens=1, **GREEDY))[0].num_cached_tokens == 0
        assert engine.block_pool.num_evictable_blocks == 2  # the whole block and the 2-row tail
        out = engine.generate([second], SamplingParams(max_tokens=2, **GREEDY))[0]
        assert out.num_cached_tokens == cached, num_blocks
        assert out.outputs[0].token_ids == cold(second, 2)
        assert engine.scheduler.num_preemptions == 0
        engine.block_pool.check_invariants()


def test_a_tail_no_row_of_which_is_copied_stays_least_recently_used() -> None:
    """A prompt one token past its whole-block hit takes no row of the tail that continues it (its last token
    is always computed), so that tail is not touched: it stays first in the LRU and is the block evicted
    next, while a tail cached after it stays findable."""
    engine = new_engine(num_blocks=5)
    whole = [11, 12, 13, 14]
    rows = computed_rows(engine, whole + [21, 22], 1)  # the whole block, then the tail [21, 22]
    assert rows == whole + [21, 22]
    computed_rows(engine, [31, 32], 1)  # a tail under the root, cached after [21, 22]
    out = engine.generate([whole + [21]], SamplingParams(max_tokens=1, **GREEDY))[0]
    assert out.num_cached_tokens == 4 and out.outputs[0].token_ids == cold(whole + [21], 1)
    assert engine.block_pool.num_free_blocks - engine.block_pool.num_evictable_blocks == 1  # one never used
    computed_rows(engine, [41 + i for i in range(8)], 1)  # 2 new blocks: the free one and one evicted
    root = _root_of(engine)
    key = engine.prefix_cache.match(whole, root)[1][0]
    found = engine.prefix_cache.match_tail(whole + [21, 22], key, 4)
    assert found is not None and found[1] == 1  # only the last request's own tail [21] is left under the block
    assert engine.prefix_cache.match_tail([31, 32], root, 0)[1] == 2  # the later tail was not evicted
    engine.block_pool.check_invariants()


@pytest.mark.parametrize("kind", ["sliding window", "policy", "kv groups"])
def test_only_a_plain_engine_keeps_tails(kind) -> None:
    """A sliding-window model, a cache policy and a hybrid model's groups keep no tail (their blocks leave the
    table): a finished request leaves its whole blocks cached and frees its partial last block."""
    if kind == "sliding window":
        engine = new_engine(TinyLlama(seed=2, sliding_window=3))
    elif kind == "policy":
        engine = new_engine(kv_policy="window:16")
    else:
        engine = new_engine(TinyLlama(seed=4, num_hidden_layers=2, interleaved_sliding_window=3,
                                      layer_types=("sliding_attention", "full_attention")))
    prompt = [11, 12, 13, 14, 15, 16]  # a whole block of 4 and 2 rows
    assert computed_rows(engine, prompt, 1) == prompt
    root = _root_of(engine)
    hits, keys = engine.prefix_cache.match(prompt, root)
    assert len(hits) == 1 and engine.block_pool.num_evictable_blocks == 1
    assert engine.prefix_cache.match_tail(prompt, keys[0], 4) is None
    engine.block_pool.check_invariants()


def test_blocks_of_one_token_reuse_a_prefix_held_past_the_pools_first_blocks() -> None:
    """With block_size 1 a hit's first block is visible too: a request served from blocks that are not the
    pool's first ones gets full recompute's tokens (a table reading block 0 there would not)."""
    engine = new_engine(block_size=1, num_blocks=64)
    computed_rows(engine, [200, 201, 202], 1)  # takes blocks 0-2, which stay cached
    prompt = [5, 6, 7, 8, 9]
    computed_rows(engine, prompt, 1)
    out = engine.generate([prompt + [10, 11]], SamplingParams(max_tokens=3, **GREEDY))[0]
    assert out.num_cached_tokens == 5
    assert out.outputs[0].token_ids == cold(prompt + [10, 11], 3)
    engine.block_pool.check_invariants()


@pytest.mark.parametrize("length", [5, 14])
def test_reloading_rows_all_cached_finds_the_tail_under_the_last_whole_block(tmp_path, length) -> None:
    """One whole block and a tail, or three and a tail, all cached already: the reload looks for the tail
    under the last whole block's key, reports every row and allocates nothing."""
    eng = new_engine()
    rows = computed_rows(eng, list(range(60, 60 + length)), 1)
    assert save_session(eng, tmp_path / "s.kvc", rows, {}) == length
    free, cached_blocks = eng.block_pool.num_free_blocks, eng.prefix_cache.num_cached_blocks
    assert load_session(eng, tmp_path / "s.kvc")[1] == length
    assert eng.block_pool.num_free_blocks == free and eng.prefix_cache.num_cached_blocks == cached_blocks
    again = eng.generate([rows + [7]], SamplingParams(max_tokens=1, **GREEDY))[0]
    assert again.num_cached_tokens == length and again.outputs[0].token_ids == cold(rows + [7], 1)
    eng.block_pool.check_invariants()
