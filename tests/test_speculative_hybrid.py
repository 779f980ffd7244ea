"""Speculation on a hybrid model (sliding layers beside full ones, one KV-cache group per window): guesses
verified in one forward and rolled back in every group give plain decoding's tokens, and every group's pool
balances. Why: a rejected row must vanish from the sliding groups' tables too, and a sliding group trims blocks
behind its window while guesses run ahead of it (issue 35's rollback in every cache, issue 34's groups)."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings, strategies as st

from kvlab import Engine, SamplingParams, TinyLlama
from kvlab.engine.draft import DraftProposer

from test_speculative import NGRAM, repetitive

S, F = "sliding_attention", "full_attention"


def hybrid(window: int) -> TinyLlama:
    return TinyLlama(seed=4, num_hidden_layers=3, layer_types=(S, S, F), interleaved_sliding_window=window)


def tokens(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    outs = engine.generate(prompts, params)
    for group in engine.kv_groups:
        group.pool.check_invariants()
        assert group.pool.num_used_blocks == 0
    return [out.outputs[0].token_ids for out in outs]


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(window=st.sampled_from([4, 8, 12]), k=st.integers(1, 5), block_size=st.sampled_from([2, 4, 8]),
       lengths=st.lists(st.integers(3, 30), min_size=1, max_size=3), new=st.integers(1, 20),
       sampled=st.booleans(), chunk=st.integers(4, 24), draft=st.booleans())
def test_speculation_on_a_hybrid_model_emits_plain_decodings_tokens(window, k, block_size, lengths, new, sampled,
                                                                     chunk, draft):
    model = hybrid(window)
    prompts = [repetitive(i, n) for i, n in enumerate(lengths)]
    params = [SamplingParams(max_tokens=new, ignore_eos=True,
                             **(dict(temperature=0.9, seed=5 + i) if sampled else {})) for i in range(len(prompts))]
    settings_ = dict(block_size=block_size, max_num_batched_tokens=chunk, max_num_seqs=3)
    plain = Engine(model, **settings_)
    spec = Engine(model, speculative_config={**NGRAM, "num_speculative_tokens": k}, **settings_)
    if draft:  # the model as its own draft: every guess is kept, so rows run far past the sliding windows
        spec.speculator.draft = DraftProposer(model)
    assert tokens(spec, prompts, params) == tokens(plain, prompts, params)


def test_guesses_run_past_the_sliding_window_and_are_kept():
    """The property above could pass with no guess made: here 5 guesses a step are made and kept, across
    blocks the sliding group has already given back."""
    model = hybrid(4)
    prompt, params = [repetitive(0, 40)], [SamplingParams(max_tokens=30, ignore_eos=True)]
    plain = Engine(model, block_size=2, max_num_seqs=1)
    spec = Engine(model, block_size=2, max_num_seqs=1, speculative_config={**NGRAM, "num_speculative_tokens": 5})
    spec.speculator.draft = DraftProposer(model)  # the model as its own draft: every guess is the right one
    assert tokens(spec, prompt, params) == tokens(plain, prompt, params)
    stats = spec.stats()
    assert stats["spec_decode_num_accepted_tokens"] > 10 and spec.counters.num_steps < plain.counters.num_steps
