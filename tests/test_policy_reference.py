"""PolicyCache (kvlab/verify/policy_reference.py), the policy done by hand that kvlab verify and the engine's
policy tests hold the engine to: its refusals, its eviction count, its logits_to_keep, and NoPE layers
(keys with no rotation move as they are)."""

from __future__ import annotations

import numpy as np
import pytest

from kvlab import Engine, TinyLlama
from kvlab.policies import AttentionSinks, ContextShift, Policy, SlidingWindow
from kvlab.verify.policy_reference import PolicyCache

MODEL = TinyLlama(seed=6)  # float64


class Keeps(Policy):
    """A policy of budget 4 that keeps the rows it is told to (and claims anything else is fine)."""

    budget, name = 4, "keeps"

    def __init__(self, rows: list[int]) -> None:
        self.rows = rows

    def keep(self, length: int, num_new: int) -> np.ndarray:
        return np.array(self.rows, dtype=np.int64)


def test_a_chunk_outside_the_policy_and_rows_it_cannot_keep_are_refused_by_name():
    cache = PolicyCache(MODEL, SlidingWindow(4))
    for num_new in (0, 5):
        with pytest.raises(ValueError, match=rf"^window:4 takes 1\.\.4 new tokens a chunk, got {num_new}$"):
            cache.make_room(num_new)
    for rows in ([2, 1], [1, 1], [0, 1, 2, 3]):  # not ascending, a row twice, kept + new over the budget
        bad = PolicyCache(MODEL, Keeps(rows))
        bad.feed([5, 6, 7, 8])
        with pytest.raises(ValueError) as caught:
            bad.feed([9])
        assert str(caught.value) == f"keeps kept rows {rows} of 4: not ascending within its budget"
        assert bad.length == 4  # nothing dropped


def test_evicted_counts_the_rows_one_feed_dropped():
    cache = PolicyCache(MODEL, SlidingWindow(4))
    assert cache.evicted == 0 and cache.length == 0
    cache.feed(list(range(10)), chunk=2)  # 2, 4, then each chunk of 2 drops 2
    assert cache.evicted == 6 and cache.length == 4
    cache.feed([3])
    assert cache.evicted == 1 and cache.length == 4  # the last feed's, not a running total
    shift = PolicyCache(MODEL, ContextShift(1, 8))
    shift.feed(list(range(9)), chunk=1)  # full at 8: keep 1, drop half of the other 7 (3), then the 9th
    assert shift.evicted == 3 and shift.length == 6


def test_logits_to_keep_gives_each_chunks_last_rows():
    ids = list(range(20, 30))
    every = PolicyCache(MODEL, AttentionSinks(1, 5)).feed(ids, chunk=2)
    last = PolicyCache(MODEL, AttentionSinks(1, 5)).feed(ids, chunk=2, logits_to_keep=1)
    assert every.shape == (10, MODEL.config.vocab_size) and last.shape == (5, MODEL.config.vocab_size)
    assert np.array_equal(last, every[1::2])


@pytest.mark.parametrize("policy", [AttentionSinks(2, 6), ContextShift(2, 8)])
def test_nope_layers_move_their_keys_unrotated_in_both_the_engine_and_the_reference(policy):
    """SmolLM3's NoPE layers (here layer 1 of 2): a key without a rotation must not be given one when it
    moves. Rotating it, in either, would make them disagree."""
    model = TinyLlama(seed=6, no_rope_layers=(1, 0))
    stream = list(np.random.default_rng(5).integers(0, 256, 30))
    engine = Engine(model, block_size=4, num_blocks=20, max_num_batched_tokens=1, kv_policy=policy,
                    enable_prefix_caching=False)
    got = np.stack(engine.score(stream).logits)
    want = PolicyCache(model, policy).feed(stream, chunk=1)
    assert np.abs(got - want).max() < 1e-10
    rotated_model = TinyLlama(seed=6)  # the same weights with every layer rotated gives other logits
    assert np.abs(PolicyCache(rotated_model, policy).feed(stream, chunk=1) - want).max() > 1e-3
