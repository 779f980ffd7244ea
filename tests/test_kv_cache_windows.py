"""The contiguous KVCache on hybrid models: sliding layers give back their rows before the window.

`new_cache(spec, windows=[...])` (one window or None per layer, `ModelConfig.layer_window`) keeps each
sliding layer's rows from where the next query's window starts, moved down once it holds max(W, 16) more, so
a sliding layer holds fewer than 2W + 16 rows after each forward however long the text. The logits stay full
recompute's (prefill in chunks, decode steps, both backends), a fork continues exactly, and what a trimmed
cache cannot do (crop into rows it gave back, keep rows for a policy) is refused, changing nothing.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from kvlab import TinyLlama
from kvlab.cache.kv_cache import MIN_CAPACITY, new_cache
from kvlab.errors import InputError

S, F = "sliding_attention", "full_attention"
MODELS = {}


def model(window: int, pattern: tuple[str, ...], backend: str | None = None) -> TinyLlama:
    key = (window, pattern, backend)
    if key not in MODELS:
        MODELS[key] = TinyLlama(seed=4, num_hidden_layers=len(pattern), layer_types=pattern,
                                interleaved_sliding_window=window, backend=backend)
    return MODELS[key]


def windows(m: TinyLlama) -> list[int | None]:
    return [m.config.layer_window(i) for i in range(m.config.num_hidden_layers)]


def check_held(cache, m: TinyLlama) -> None:
    for layer, window in enumerate(windows(m)):
        held = cache[layer][0].shape[2]
        if window is None:
            assert held == cache.get_seq_length() and cache.layer_start(layer) == 0
        else:
            assert held == cache.get_seq_length() - cache.layer_start(layer)
            assert held <= window - 2 + max(window, MIN_CAPACITY)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(window=st.sampled_from([1, 2, 3, 5, 8, 20]), pattern=st.sampled_from([(S, F), (F, S, S), (S, S, F, S)]),
       backend=st.sampled_from([None, "numpy"]), chunks=st.lists(st.integers(1, 24), min_size=1, max_size=14))
def test_chunked_prefill_and_decode_give_full_recompute_logits(window, pattern, backend, chunks):
    m = model(window, pattern, backend)
    total = sum(chunks)
    ids = [(7 * t + 3) % 250 for t in range(total)]
    want = m.forward([ids]).logits[0]
    cache = new_cache(m.cache_spec, windows=windows(m))
    start = 0
    for n in chunks:
        got = m.forward([ids[start:start + n]], cache=cache).logits[0]
        np.testing.assert_allclose(got, want[start:start + n], rtol=0, atol=1e-10)
        start += n
        check_held(cache, m)


def test_a_long_text_holds_its_window_in_the_sliding_layers():
    m = model(8, (S, S, S, S, S, F))
    cache = new_cache(m.cache_spec, windows=windows(m))
    ids = [(5 * t + 1) % 250 for t in range(300)]
    m.forward([ids[:200]], cache=cache)
    for token in ids[200:]:
        m.forward([[token]], cache=cache)
    check_held(cache, m)
    rows = [cache[i][0].shape[2] for i in range(6)]
    assert rows[5] == 300 and max(rows[:5]) < 8 + 16
    plain = 2 * 6 * 300 * 2 * 8 * 8  # K and V, 6 layers, 300 tokens, 2 heads, head_dim 8, float64
    assert cache.memory_report().payload_bytes == 2 * 2 * 8 * 8 * sum(rows) < plain / 4
    # the arrays too: the 200-token prefill's rows shrank back to the window's once given back
    untrimmed = new_cache(m.cache_spec)
    m.forward([ids], cache=untrimmed)
    assert cache.memory_report().capacity_bytes < untrimmed.memory_report().capacity_bytes / 3


def test_a_fork_continues_exactly():
    m = model(3, (S, F, S))
    ids = [(3 * t + 2) % 250 for t in range(60)]
    cache = new_cache(m.cache_spec, windows=windows(m))
    m.forward([ids[:50]], cache=cache)
    branch = cache.fork()
    assert [branch.layer_start(i) for i in range(3)] == [cache.layer_start(i) for i in range(3)] != [0, 0, 0]
    other = ids[:50] + [9] * 10
    got = m.forward([ids[50:]], cache=cache).logits[0]
    got_branch = m.forward([other[50:]], cache=branch).logits[0]
    np.testing.assert_allclose(got, m.forward([ids]).logits[0, 50:], rtol=0, atol=1e-10)
    np.testing.assert_allclose(got_branch, m.forward([other]).logits[0, 50:], rtol=0, atol=1e-10)


def test_crop_goes_back_only_within_the_rows_kept():
    m = model(4, (S, F))
    ids = [(3 * t + 2) % 250 for t in range(40)]
    cache = new_cache(m.cache_spec, windows=windows(m))
    m.forward([ids], cache=cache)
    first = cache.layer_start(0)
    assert first == 40 - 4 + 1
    with pytest.raises(InputError, match="sliding layer .* gave back the rows before position 37"):
        cache.crop(39)  # a query at 39 sees from 36
    assert cache.get_seq_length() == 40 and cache.layer_start(0) == first  # refused: nothing changed
    m.forward([ids[:2]], cache=cache)  # 42 tokens: crop back to 40 is within what the layer kept
    cache.crop(40)
    np.testing.assert_allclose(m.forward([[7]], cache=cache).logits[0],
                               m.forward([ids + [7]]).logits[0, -1:], rtol=0, atol=1e-10)


def test_crop_to_0_always_works():
    m = model(4, (S, F))
    ids = [(3 * t + 2) % 250 for t in range(40)]
    cache = new_cache(m.cache_spec, windows=windows(m))
    m.forward([ids], cache=cache)
    cache.crop(0)
    assert cache.layer_start(0) == 0
    np.testing.assert_allclose(m.forward([ids[:10]], cache=cache).logits[0], m.forward([ids[:10]]).logits[0],
                               rtol=0, atol=1e-10)


def test_a_quantized_cache_keeps_every_row():
    m = model(4, (S, F))
    ids = [(3 * t + 2) % 250 for t in range(40)]
    trimmed = new_cache(m.cache_spec, kv_dtype="int8", windows=windows(m))
    plain = new_cache(m.cache_spec, kv_dtype="int8")
    a = m.forward([ids], cache=trimmed).logits
    b = m.forward([ids], cache=plain).logits
    assert not trimmed.trims and trimmed[0][0].shape[2] == 40
    np.testing.assert_array_equal(a, b)


def test_windows_must_name_every_layer():
    m = model(4, (S, F))
    with pytest.raises(InputError, match="one window .* per layer: 2, got 1"):
        new_cache(m.cache_spec, windows=[4])


def test_generate_on_a_hybrid_model_trims_its_own_cache_and_keeps_full_recompute_tokens():
    """kvlab.generate builds a trimming cache for a hybrid model (no policy): greedy tokens equal full
    recompute's (use_cache=False) far past the window; a cache passed in is used as given."""
    import kvlab

    m = model(3, (S, S, F))
    ids = np.array([[(7 * t + 3) % 250 for t in range(45)]])
    want = kvlab.generate(m, ids, 30, use_cache=False)
    assert np.array_equal(kvlab.generate(m, ids, 30), want)
    cache = new_cache(m.cache_spec, windows=windows(m))
    assert np.array_equal(kvlab.generate(m, ids, 30, cache=cache), want)
    assert cache.layer_start(0) > 0 and cache[0][0].shape[2] < 3 + MIN_CAPACITY
