"""Engine.score: the logits after every prompt token, as the engine computes them (what `kvlab fidelity`
compares), equal a full recompute's on an exact pool whatever the chunks, beside other requests, and when
the scoring request is preempted and recomputed."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from kvlab import Engine, SamplingParams, TinyLlama
from kvlab.errors import ContextLengthError

MODEL = TinyLlama(seed=3)  # float64


def full(prompt: list[int]) -> np.ndarray:
    return MODEL.forward(np.asarray([prompt])).logits[0]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompt=st.lists(st.integers(0, 255), min_size=1, max_size=40), chunk=st.integers(1, 9),
       block_size=st.sampled_from([1, 4, 16]), prefix_caching=st.booleans())
def test_every_prompt_position_gets_the_full_recompute_logits(prompt, chunk, block_size, prefix_caching):
    engine = Engine(MODEL, block_size=block_size, max_num_batched_tokens=chunk,
                    enable_prefix_caching=prefix_caching)
    engine.generate([prompt], SamplingParams(max_tokens=1))  # a warm prefix cache must not skip any row
    score = engine.score(prompt)
    got = np.stack(score.logits)
    assert got.shape == (len(prompt), MODEL.config.vocab_size)
    assert np.abs(got - full(prompt)).max() < 1e-12
    assert score.peak_rows == score.rows == len(prompt)  # no policy: every row held
    assert not engine.has_unfinished_requests() and engine.block_pool.num_used_blocks == 0


def test_other_requests_run_beside_it_and_keep_their_outputs():
    engine = Engine(MODEL, block_size=4, max_num_batched_tokens=6)
    alone = Engine(MODEL, block_size=4).generate([[5, 6, 7]], SamplingParams(max_tokens=8, ignore_eos=True))
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=8, ignore_eos=True))
    prompt = list(range(20, 50))
    assert np.abs(np.stack(engine.score(prompt).logits) - full(prompt)).max() < 1e-12
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    outputs += engine.step()
    finished = [o for o in outputs if o.request_id == "a" and o.finished]
    assert finished and finished[0].outputs[0].token_ids == alone[0].outputs[0].token_ids


def test_a_preempted_scoring_request_is_recomputed_row_for_row():
    engine = Engine(MODEL, block_size=4, num_blocks=10, max_num_batched_tokens=4)
    engine.add_request("a", list(range(22)), SamplingParams(max_tokens=16, ignore_eos=True))  # 10 blocks at the end
    first = engine.scheduler.waiting[0]
    while first.num_computed_tokens < 22:
        engine.step()
    prompt = list(range(100, 120))
    score = engine.score(prompt)
    assert engine.scheduler.num_preemptions > 0
    got = np.stack(score.logits)
    assert got.shape[0] == len(prompt) and np.abs(got - full(prompt)).max() < 1e-12


def test_a_prompt_as_long_as_the_context_is_scored_and_a_longer_one_refused():
    engine = Engine(MODEL, block_size=4, max_model_len=32)
    assert len(engine.score(list(range(32))).logits) == 32  # no new token needs a position
    with pytest.raises(ContextLengthError, match="exceed max_model_len 32"):
        engine.score(list(range(33)))
    assert not engine.has_unfinished_requests() and engine.block_pool.num_used_blocks == 0
