"""fork(): both sides write after the branch point, and each must still equal a full recompute.

A fork that shared storage with its parent would pass any test that only writes to one side; here the
parent continues after the branch has written (and the other way round), crops below the branch point and
rewrites, and every live cache's stored rows are compared with a fresh prefill of its own tokens.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from kvlab import LlamaModel, ModelConfig, TinyLlama

TOL = 1e-10  # chunked vs one-shot float64 prefill differ by ~1e-15 (rounding in different matmul shapes)

MODEL = TinyLlama(seed=11, max_position_embeddings=96)


def full_logits(model, tokens: list[int]) -> np.ndarray:
    return model.forward(np.array([tokens])).logits[0]


def assert_rows_equal_fresh_prefill(model, cache, tokens: list[int]) -> None:
    """Every layer's cached keys/values equal those of a fresh prefill of `tokens`."""
    assert cache.get_seq_length() == len(tokens)
    np.testing.assert_array_equal(cache.positions, np.arange(len(tokens)))
    if not tokens:
        return
    fresh = model.forward(np.array([tokens]), use_cache=True).cache
    for (k, v), (fk, fv) in zip(cache, fresh):
        assert np.abs(k - fk).max() <= TOL and np.abs(v - fv).max() <= TOL


def test_parent_continues_after_the_branch_has_written() -> None:
    model, prefix = MODEL, [5, 9, 2, 7]
    parent = model.forward(np.array([prefix]), use_cache=True).cache
    branch = parent.fork()
    b1 = model.forward(np.array([[30, 31, 32]]), cache=branch).logits[0]   # the branch writes first
    p1 = model.forward(np.array([[40, 41]]), cache=parent).logits[0]       # then the parent, same rows
    b2 = model.forward(np.array([[33]]), cache=branch).logits[0]           # and the branch again
    np.testing.assert_allclose(p1, full_logits(model, prefix + [40, 41])[4:], rtol=0, atol=TOL)
    np.testing.assert_allclose(b1, full_logits(model, prefix + [30, 31, 32])[4:], rtol=0, atol=TOL)
    np.testing.assert_allclose(b2, full_logits(model, prefix + [30, 31, 32, 33])[7:], rtol=0, atol=TOL)
    assert_rows_equal_fresh_prefill(model, parent, prefix + [40, 41])
    assert_rows_equal_fresh_prefill(model, branch, prefix + [30, 31, 32, 33])


def test_parent_crops_below_the_branch_point_and_rewrites() -> None:
    model, prefix = MODEL, [1, 2, 3, 4, 5, 6]
    parent = model.forward(np.array([prefix]), use_cache=True).cache
    branch = parent.fork()
    parent.crop(2)
    model.forward(np.array([[60, 61, 62, 63, 64]]), cache=parent)  # overwrites rows 2..6 of the parent
    got = model.forward(np.array([[7]]), cache=branch).logits[0]
    np.testing.assert_allclose(got, full_logits(model, prefix + [7])[6:], rtol=0, atol=TOL)
    assert_rows_equal_fresh_prefill(model, branch, prefix + [7])
    assert_rows_equal_fresh_prefill(model, parent, [1, 2, 60, 61, 62, 63, 64])


def test_both_sides_grow_past_their_capacity() -> None:
    """Reallocation on one side (capacity doubling) must not re-link it to the other's storage."""
    model, prefix = MODEL, list(range(1, 15))
    parent = model.forward(np.array([prefix]), use_cache=True).cache
    branch = parent.fork()
    grow_b, grow_p = list(range(100, 140)), list(range(200, 230))
    model.forward(np.array([grow_b]), cache=branch)
    model.forward(np.array([grow_p]), cache=parent)
    assert branch.store.capacity_tokens >= 54 and parent.store.capacity_tokens >= 44
    assert_rows_equal_fresh_prefill(model, branch, prefix + grow_b)
    assert_rows_equal_fresh_prefill(model, parent, prefix + grow_p)


def test_fork_of_an_empty_cache_and_of_a_low_precision_cache() -> None:
    model = MODEL
    empty = model.new_cache()
    twin = empty.fork()
    model.forward(np.array([[3, 4]]), cache=twin)
    assert empty.get_seq_length() == 0 and twin.get_seq_length() == 2
    half = model.new_cache(kv_dtype="float16")
    model.forward(np.array([[3, 4, 5]]), cache=half)
    copy = half.fork()
    assert copy.dtype == np.float16 and copy.get_seq_length() == 3
    assert copy[0][0].dtype == np.float16 and copy.memory_report().capacity_bytes == 2 * 2 * 2 * 16 * 8 * 2
    model.forward(np.array([[9]]), cache=copy)
    model.forward(np.array([[8]]), cache=half)
    # the shared prefix rows are bit-identical; the rows written after the fork differ
    for (k1, v1), (k2, v2) in zip(half, copy):
        np.testing.assert_array_equal(k1[:, :, :3], k2[:, :, :3])
        assert not np.array_equal(k1[:, :, 3], k2[:, :, 3]) and not np.array_equal(v1[:, :, 3], v2[:, :, 3])


@st.composite
def small_configs(draw):
    kv_heads = draw(st.integers(1, 3))
    return ModelConfig(vocab_size=draw(st.integers(8, 200)), hidden_size=draw(st.sampled_from([8, 16])),
                       intermediate_size=draw(st.integers(4, 32)), num_hidden_layers=draw(st.integers(1, 2)),
                       num_attention_heads=kv_heads * draw(st.integers(1, 2)), num_key_value_heads=kv_heads,
                       head_dim=draw(st.sampled_from([2, 4, 8, 16])), max_position_embeddings=64)


@given(config=small_configs(), data=st.data())
def test_any_tree_of_forks_keeps_every_cache_exact(config, data) -> None:
    """Random appends, crops and forks on any live cache; every cache always equals its own recompute."""
    model = LlamaModel(config, dtype=np.float64, seed=3)
    ids = st.integers(0, config.vocab_size - 1)
    live = [(model.new_cache(), [])]  # (cache, the tokens it holds)
    for _ in range(data.draw(st.integers(1, 8))):
        i = data.draw(st.integers(0, len(live) - 1))
        cache, tokens = live[i]
        action = data.draw(st.sampled_from(["append", "crop", "fork"]))
        if action == "fork":
            live.append((cache.fork(), list(tokens)))
        elif action == "crop" and tokens:
            keep = data.draw(st.integers(0, len(tokens) - 1))
            cache.crop(keep)
            live[i] = (cache, tokens[:keep])
        else:
            new = data.draw(st.lists(ids, min_size=1, max_size=min(20, 64 - len(tokens)))) \
                if len(tokens) < 64 else []
            if new:
                got = model.forward(np.array([new]), cache=cache).logits[0]
                want = full_logits(model, tokens + new)[len(tokens):]
                assert np.abs(got - want).max() <= TOL
                live[i] = (cache, tokens + new)
    for cache, tokens in live:
        assert_rows_equal_fresh_prefill(model, cache, tokens)
