"""The engine's decode-step shortcuts against the general code they shortcut (issue 33: `kvlab generate` on the
engine within a few per cent of the contiguous loop's decode).

A decode step (every scheduled sequence computes one token, guesses none) takes `ModelRunner._prepare_decodes`
instead of the general `_prepare_chunks`, and `PagedAttention` plans it without the prefill chunks' bookkeeping;
the layers' windows are worked out once per (frozen) config; `PagedDecodeCall` scales each layer's queries into
one buffer. What must hold: the shortcut's batch is the general batch, field by field, on every step of runs
that cover windows, hybrid groups, cache policies, speculation, n > 1 and preemption; the reused buffer never
leaks into a returned output; a new config never gets another config's windows.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kvlab import Engine, SamplingParams, TinyLlama
from kvlab.engine.model_runner import ModelRunner
from kvlab.model.attention import layer_windows
from kvlab.model.batch import BatchInput

S, F = "sliding_attention", "full_attention"


def same_batch(a: BatchInput, b: BatchInput) -> None:
    for field in dataclasses.fields(BatchInput):
        x, y = getattr(a, field.name), getattr(b, field.name)
        if field.name == "window_tables" and x is not None:
            assert y is not None and x.keys() == y.keys(), field.name
            for window in x:
                assert x[window][0] == y[window][0], field.name
                assert np.array_equal(x[window][1], y[window][1]) and x[window][1].dtype == y[window][1].dtype
        elif isinstance(x, np.ndarray):
            assert isinstance(y, np.ndarray) and x.dtype == y.dtype and np.array_equal(x, y), field.name
        else:
            assert x == y, field.name


@pytest.fixture
def checked_prepare(monkeypatch):
    """Every decode step's batch built both ways and compared (counters included); returns the steps seen."""
    seen = {"decode": 0, "other": 0}
    real_decodes, real_chunks = ModelRunner._prepare_decodes, ModelRunner._prepare_chunks

    def both(self, seqs):
        before = (self.counters.num_computed_tokens, self.counters.num_prefill_tokens)
        batch, sampled = real_decodes(self, seqs)
        after = (self.counters.num_computed_tokens, self.counters.num_prefill_tokens)
        self.counters.num_computed_tokens, self.counters.num_prefill_tokens = before
        want, want_sampled = real_chunks(self, [(seq, 1) for seq in seqs])
        assert (self.counters.num_computed_tokens, self.counters.num_prefill_tokens) == after
        same_batch(batch, want)
        assert sampled == want_sampled
        seen["decode"] += 1
        return batch, sampled

    def chunks(self, scheduled):
        seen["other"] += 1
        return real_chunks(self, scheduled)

    monkeypatch.setattr(ModelRunner, "_prepare_decodes", both)
    monkeypatch.setattr(ModelRunner, "_prepare_chunks", chunks)
    return seen


def finish(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> list[list[list[int]]]:
    return [[c.token_ids for c in out.outputs] for out in engine.generate(prompts, params)]


@pytest.mark.parametrize("model_args, engine_args, params", [
    ({}, {"max_num_seqs": 3}, SamplingParams(max_tokens=9, ignore_eos=True)),
    ({"sliding_window": 6}, {"max_num_seqs": 3, "block_size": 4}, SamplingParams(max_tokens=9, ignore_eos=True)),
    ({"num_hidden_layers": 3, "layer_types": (S, S, F), "interleaved_sliding_window": 5},
     {"max_num_seqs": 3, "block_size": 4}, SamplingParams(max_tokens=9, ignore_eos=True)),
    ({}, {"max_num_seqs": 3, "block_size": 4, "kv_policy": "sinks:4:12"}, SamplingParams(max_tokens=16, ignore_eos=True)),
    ({}, {"max_num_seqs": 4, "block_size": 4}, SamplingParams(max_tokens=7, n=2, temperature=0.9, seed=3,
                                                              ignore_eos=True)),
    ({}, {"max_num_seqs": 3, "block_size": 4, "num_blocks": 9}, SamplingParams(max_tokens=12, ignore_eos=True)),
    ({}, {"max_num_seqs": 2, "block_size": 4, "max_num_batched_tokens": 1}, SamplingParams(max_tokens=3,
                                                                                         ignore_eos=True)),
])
def test_a_decode_steps_batch_is_the_general_batch(checked_prepare, model_args, engine_args, params):
    """Windows, hybrid groups, a cache policy (key starts, evictions), n > 1 forks, a pool small enough to
    preempt, one-token chunks (a budget of one token a step): every decode step's shortcut batch is the
    general one, and the tokens are those of an engine whose steps all take the general path."""
    model = TinyLlama(seed=2, **model_args)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [3, 4, 5], [9, 8, 7, 6, 5, 4, 3, 2, 1, 2, 3]]
    tokens = finish(Engine(model, **engine_args), prompts, params)
    assert checked_prepare["decode"] > 0
    general = Engine(model, **engine_args)
    general.runner.prepare = general.runner._prepare_chunks  # every step the general way
    assert tokens == finish(general, prompts, params)


def test_speculating_steps_take_the_general_batch_and_their_tokens_stay(checked_prepare):
    """Prompt lookup's verification rows are never a plain decode step: those steps take the general path,
    the rest the shortcut, and the greedy tokens are those without speculation."""
    model = TinyLlama(seed=2)
    prompt = [4, 5, 6, 7, 4, 5, 6, 7, 4, 5, 6, 7]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    plain = finish(Engine(model, block_size=4), [prompt], params)
    spec = Engine(model, block_size=4, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                           "prompt_lookup_max": 3, "prompt_lookup_min": 1})
    assert finish(spec, [prompt], params) == plain
    assert checked_prepare["other"] > 1


def test_the_decode_call_reuses_its_query_buffer_but_never_its_output():
    """One PagedDecodeCall per step, called by every layer: the second call's output leaves the first's as it
    was; a call with another scale or dtype scales by that one. Each result is the NumPy twin's."""
    pytest.importorskip("numba")
    from kvlab.kernels.attention import (
        PagedDecodeCall,
        paged_decode_attention_reference,
    )

    rng = np.random.default_rng(0)
    blocks, kv_heads, size, d, heads = 5, 2, 4, 16, 4
    k = rng.standard_normal((blocks, kv_heads, size, d))
    v = rng.standard_normal((blocks, kv_heads, size, d))
    tables, lens = np.array([[3, 1, 4], [0, 2, 1]]), np.array([11, 6])
    call = PagedDecodeCall(tables, lens, None, size, kv_heads)
    for dtype, tol in ((np.float64, 1e-12), (np.float32, 1e-5)):
        kd, vd = k.astype(dtype), v.astype(dtype)
        q1, q2 = (rng.standard_normal((2, heads, d)).astype(dtype) for _ in range(2))
        first = call(q1, kd, vd, 0.25)
        kept = first.copy()
        second = call(q2, kd, vd, 0.25)
        third = call(q2, kd, vd)  # the default scale, 1/sqrt(d)
        assert np.array_equal(first, kept) and first is not second
        for out, q, scale in ((first, q1, 0.25), (second, q2, 0.25), (third, q2, None)):
            assert out.dtype == dtype
            want = paged_decode_attention_reference(q, kd, vd, tables, lens, scale=scale)
            assert np.abs(out - want).max() <= tol


def test_layer_windows_are_each_configs_own():
    """The windows list is worked out once per config; a changed config (a new object) gets its own, also
    after more configs than are kept at once."""
    base = TinyLlama(seed=0, num_hidden_layers=3).config
    assert layer_windows(base) == [None, None, None] and layer_windows(base) is layer_windows(base)
    for window in range(1, 70):
        config = dataclasses.replace(base, layer_types=(S, F, S), interleaved_sliding_window=window)
        assert layer_windows(config) == [window, None, window]
    assert layer_windows(dataclasses.replace(base, sliding_window=9)) == [9, 9, 9]
    assert layer_windows(base) == [None, None, None]
