"""Token-granular prefix reuse in the engine: a request reuses every row an earlier one computed for the
tokens they share (whole blocks by chain key, then the rows of a cached tail or of a full block it parts
from, copied into a private block), and what it computes stays exact.

Why it matters: `kvlab chat` and `--prompt-cache` run on the engine, and a conversation's next turn must
reuse every row of the last one, as the contiguous session did, not only its whole blocks."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings, strategies as st

from kvlab import TinyLlama
from kvlab.engine.engine import Engine
from kvlab.sessions.session_io import load_session, save_session
from kvlab.sampling.sampler import SamplingParams

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
