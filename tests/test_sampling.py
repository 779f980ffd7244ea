"""Sampling against hand-computed distributions, and properties of the filtered support.

Both sides of a cached-vs-uncached comparison use the same sampler, so those tests cannot see a wrong
filter. Here every expected distribution is worked out by hand from the definitions (vLLM's
SamplingParams): temperature divides the logits; top-k keeps every token whose logit is >= the k-th
largest (ties at the k-th are kept); top-p keeps the smallest prefix of the tokens sorted by probability
whose mass reaches top_p (the first token always stays); min-p keeps tokens whose probability is >= min_p
times the largest probability. Applied in that order, each on the renormalized result of the last.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from kvlab.sampling.sampler import Sampler, SamplingParams, sample_rows
from kvlab.errors import InputError

EXACT = 1e-12  # float64 softmax of a handful of logits: errors are ~1e-16; this allows a few ulps x 1e3


def probs_of(logits, **params) -> np.ndarray:
    return Sampler(SamplingParams(**{"temperature": 1.0, **params})).probabilities(np.array([logits],
                                                                                           dtype=float))[0]


def from_probs(p) -> list[float]:
    """Logits whose softmax is exactly-ish `p` (log probabilities; zeros become -inf)."""
    return [math.log(x) if x > 0 else -math.inf for x in p]


def renormalized(p, keep) -> np.ndarray:
    kept = np.array([x if i in keep else 0.0 for i, x in enumerate(p)])
    return kept / kept.sum()


# --- temperature -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0, 7.0])
def test_temperature_divides_the_logits(temperature: float) -> None:
    logits = [2.0, 1.0, 0.0, -1.0]
    weights = [math.exp(x / temperature) for x in logits]
    want = [w / sum(weights) for w in weights]
    np.testing.assert_allclose(probs_of(logits, temperature=temperature), want, rtol=0, atol=EXACT)


def test_temperature_half_squares_the_odds() -> None:
    p = probs_of([math.log(3.0), 0.0], temperature=0.5)  # odds 3:1 become 9:1
    np.testing.assert_allclose(p, [0.9, 0.1], rtol=0, atol=EXACT)


def test_greedy_is_argmax_and_takes_the_first_of_tied_maxima() -> None:
    sampler = Sampler(SamplingParams(temperature=0.0))
    logits = np.array([[0.0, 3.0, 1.0, 3.0], [5.0, -1.0, 5.0, 0.0], [-2.0, -3.0, -1.0, -9.0]])
    assert sampler(logits).tolist() == [1, 0, 2]


# --- top-k -------------------------------------------------------------------------------------------------

def test_top_k_keeps_exactly_the_k_largest_including_the_kth() -> None:
    p = [0.1, 0.4, 0.05, 0.3, 0.15]
    got = probs_of(from_probs(p), top_k=3)
    np.testing.assert_allclose(got, renormalized(p, {1, 3, 4}), rtol=0, atol=EXACT)
    assert got[4] > 0  # the k-th token (0.15) is in


def test_top_k_keeps_every_token_tied_with_the_kth() -> None:
    logits = [1.0, 3.0, 2.0, 2.0, 0.0]
    got = probs_of(logits, top_k=2)  # k-th largest logit is 2.0, held by two tokens: three survive
    w = [0.0, math.exp(3.0), math.exp(2.0), math.exp(2.0), 0.0]
    np.testing.assert_allclose(got, np.array(w) / sum(w), rtol=0, atol=EXACT)


@pytest.mark.parametrize("top_k", [0, -1, 5, 9])
def test_top_k_off_or_not_smaller_than_the_vocab_keeps_everything(top_k: int) -> None:
    p = [0.1, 0.4, 0.05, 0.3, 0.15]
    np.testing.assert_allclose(probs_of(from_probs(p), top_k=top_k), p, rtol=0, atol=EXACT)


def test_top_k_one_is_the_argmax() -> None:
    got = probs_of([0.3, 2.5, 2.4, -1.0], top_k=1)
    assert got.tolist() == [0.0, 1.0, 0.0, 0.0]


@pytest.mark.parametrize("top_k", [1, 2, 3, 5, 10, 50])
def test_top_k_on_a_realistic_vocabulary(top_k: int) -> None:
    # selection algorithms only misbehave past their small-array cases: 1000 distinct logits
    logits = np.random.default_rng(top_k).permutation(1000).astype(float)[None] / 100.0
    got = Sampler(SamplingParams(temperature=1.0, top_k=top_k)).probabilities(logits)[0]
    assert set(np.flatnonzero(got).tolist()) == set(np.argsort(-logits[0])[:top_k].tolist())


@pytest.mark.parametrize("params, message", [  # the name first, the value last: what a user must see
    ({"temperature": -0.1}, r"^temperature must be .*, got -0\.1$"),
    ({"top_k": -2}, r"^top_k .*, got -2$"),
    ({"top_k": 2.0}, r"^top_k .*, got .*2\.0$"),
    ({"top_p": 0.0}, r"^top_p must be .*, got 0\.0$"),
    ({"top_p": 1.5}, r"^top_p must be .*, got 1\.5$"),
    ({"min_p": -0.1}, r"^min_p must be .*, got -0\.1$"),
    ({"min_p": 1.5}, r"^min_p must be .*, got 1\.5$"),
])
def test_bad_parameters_are_refused_by_name(params: dict, message: str) -> None:
    with pytest.raises(InputError, match=message):
        SamplingParams(**params)


def test_parameter_limits_are_accepted() -> None:
    for params in [{"top_k": -1}, {"top_k": 0}, {"top_p": 1.0}, {"top_p": 1e-9}, {"min_p": 0.0},
                   {"min_p": 1.0}, {"temperature": 0.0}]:
        assert SamplingParams(**params) == SamplingParams(**{**SamplingParams().__dict__, **params})


def test_top_k_works_per_row() -> None:
    sampler = Sampler(SamplingParams(temperature=1.0, top_k=2))
    logits = np.array([[4.0, 3.0, 2.0, 1.0], [1.0, 2.0, 3.0, 4.0]])
    got = sampler.probabilities(logits)
    e = math.exp(1.0)
    np.testing.assert_allclose(got, [[e / (e + 1), 1 / (e + 1), 0, 0], [0, 0, 1 / (e + 1), e / (e + 1)]],
                               rtol=0, atol=EXACT)


# --- top-p -------------------------------------------------------------------------------------------------

P = [0.05, 0.5, 0.2, 0.25]  # sorted: 0.5 (1), 0.25 (3), 0.2 (2), 0.05 (0); prefix masses .5 .75 .95 1


@pytest.mark.parametrize("top_p,keep", [
    (0.01, {1}),            # the first token always stays
    (0.45, {1}),
    (0.55, {1, 3}),         # 0.5 falls short: the next token is needed to reach 0.55
    (0.74, {1, 3}),
    (0.76, {1, 3, 2}),
    (0.94, {1, 3, 2}),
    (0.96, {0, 1, 2, 3}),
    (1.0, {0, 1, 2, 3}),
])
def test_top_p_keeps_the_smallest_prefix_whose_mass_reaches_top_p(top_p: float, keep: set) -> None:
    np.testing.assert_allclose(probs_of(from_probs(P), top_p=top_p), renormalized(P, keep), rtol=0,
                               atol=EXACT)


def test_top_p_at_an_exact_prefix_mass_stops_there() -> None:
    # dyadic probabilities: softmax of log(1/2), log(1/4), ... is exact to an ulp, so the prefix mass of
    # the first two tokens is 0.75 up to rounding; top_p = 0.75 must keep two, not three
    p = [0.125, 0.5, 0.25, 0.125]
    got = probs_of(from_probs(p), top_p=0.75 - 1e-12)
    np.testing.assert_allclose(got, renormalized(p, {1, 2}), rtol=0, atol=EXACT)


def test_top_p_applies_after_top_k_on_the_renormalized_distribution() -> None:
    # top-k 2 leaves 0.5 and 0.25, renormalized to 2/3 and 1/3; top-p 0.6 then keeps only the first.
    # Applied to the unrenormalized 0.5 it would need the second token as well.
    got = probs_of(from_probs(P), top_k=2, top_p=0.6)
    np.testing.assert_allclose(got, renormalized(P, {1}), rtol=0, atol=EXACT)


# --- min-p -------------------------------------------------------------------------------------------------

def test_min_p_is_relative_to_the_largest_probability() -> None:
    p = [0.05, 0.3, 0.5, 0.15]
    # threshold 0.5 * 0.5 = 0.25: keeps 0.5 and 0.3. An absolute threshold of 0.5 would keep only 0.5.
    np.testing.assert_allclose(probs_of(from_probs(p), min_p=0.5), renormalized(p, {1, 2}), rtol=0,
                               atol=EXACT)
    # threshold 0.2 * 0.5 = 0.1: keeps 0.15 too. An absolute 0.2 would drop it.
    np.testing.assert_allclose(probs_of(from_probs(p), min_p=0.2), renormalized(p, {1, 2, 3}), rtol=0,
                               atol=EXACT)


def test_min_p_one_keeps_only_the_maxima() -> None:
    got = probs_of([1.0, 3.0, 3.0, 0.0], min_p=1.0)
    np.testing.assert_allclose(got, [0.0, 0.5, 0.5, 0.0], rtol=0, atol=EXACT)


def test_min_p_per_row_uses_each_rows_maximum() -> None:
    sampler = Sampler(SamplingParams(temperature=1.0, min_p=0.5))
    rows = [[0.6, 0.35, 0.05], [0.3, 0.3, 0.4]]
    got = sampler.probabilities(np.array([from_probs(r) for r in rows]))
    np.testing.assert_allclose(got[0], renormalized(rows[0], {0, 1}), rtol=0, atol=EXACT)
    np.testing.assert_allclose(got[1], rows[1], rtol=0, atol=EXACT)


def test_all_filters_together() -> None:
    p = [0.02, 0.4, 0.08, 0.3, 0.2]
    # top-k 4 drops 0.02 -> [.4, .08, .3, .2]/.98; top-p 0.7: .4/.98=.408 < .7, (.4+.3)/.98=.714 >= .7,
    # keeps {1, 3}; min-p 0.8: .3/.4 = .75 < .8 drops token 3 -> only token 1
    assert probs_of(from_probs(p), top_k=4, top_p=0.7, min_p=0.8).tolist() == [0, 1.0, 0, 0, 0]
    np.testing.assert_allclose(probs_of(from_probs(p), top_k=4, top_p=0.7, min_p=0.7),
                               renormalized(p, {1, 3}), rtol=0, atol=EXACT)


def test_huge_logits_and_rows_of_different_scales_do_not_overflow() -> None:
    sampler = Sampler(SamplingParams(temperature=1.0))
    got = sampler.probabilities(np.array([[1000.0, 999.0, -1000.0], [0.0, -1.0, -2.0]]))
    e1, e2 = math.exp(-1.0), math.exp(-2.0)
    np.testing.assert_allclose(got, [[1 / (1 + e1), e1 / (1 + e1), 0.0],
                                     [1 / (1 + e1 + e2), e1 / (1 + e1 + e2), e2 / (1 + e1 + e2)]],
                               rtol=0, atol=EXACT)


def test_low_precision_logits_are_computed_in_float64() -> None:
    # 60000 / 0.5 overflows float16 (max 65504): the division must not happen in the logits' dtype
    half = Sampler(SamplingParams(temperature=0.5)).probabilities(np.array([[6e4, 0.0]], dtype=np.float16))
    assert half.dtype == np.float64 and half.tolist() == [[1.0, 0.0]]
    single = Sampler(SamplingParams(temperature=1.0)).probabilities(np.array([[0.0, -20.0]], np.float32))
    assert single.dtype == np.float64
    np.testing.assert_allclose(single[0, 1], math.exp(-20) / (1 + math.exp(-20)), rtol=1e-15)


def test_top_p_one_keeps_even_a_vanishing_tail() -> None:
    # p = [0.5, 0.5, 5e-21]: the first two already sum to 1.0 in float64, but top_p = 1.0 means no filter
    got = probs_of([0.0, 0.0, -46.0])
    assert got[2] > 0 and got[2] == pytest.approx(math.exp(-46) / 2, rel=1e-12)


def test_top_p_boundary_exactly_at_a_prefix_mass() -> None:
    # four equal logits give exactly 0.25 each; prefix masses 0.25, 0.5 are exact: top_p = 0.5 keeps two
    assert probs_of([0.0, 0.0, 0.0, 0.0], top_p=0.5).tolist() == [0.5, 0.5, 0.0, 0.0]
    assert probs_of([0.0, 0.0, 0.0, 0.0], top_p=0.75).tolist() == [1 / 3, 1 / 3, 1 / 3, 0.0]


def test_top_p_ties_keep_the_lowest_token_ids() -> None:
    # 64 equally likely tokens, top_p 0.25: exactly the first 16 ids
    assert np.flatnonzero(probs_of([0.0] * 64, top_p=0.25)).tolist() == list(range(16))
    # 22 tied tokens (every third id) above 42 others: keeping 7 of the tie takes the 7 lowest ids. An
    # unstable sort of 64 elements reorders ties (numpy's quicksort puts 21 before 18 here).
    logits = [0.0 if i % 3 == 0 else -1.0 for i in range(64)]
    p1 = 1.0 / (22 + 42 * math.exp(-1.0))
    got = probs_of(logits, top_p=6.5 * p1)
    assert np.flatnonzero(got).tolist() == [0, 3, 6, 9, 12, 15, 18]


@given(row=st.lists(st.floats(-20, 20), min_size=2, max_size=40), top_k=st.integers(1, 45))
def test_top_k_support_is_exactly_the_tokens_at_or_above_the_kth_logit(row, top_k) -> None:
    logits = np.array([row])
    got = Sampler(SamplingParams(temperature=1.0, top_k=top_k)).probabilities(logits)[0]
    kth = np.sort(logits[0])[-min(top_k, len(row))]
    assert set(np.flatnonzero(got > 0).tolist()) == set(np.flatnonzero(logits[0] >= kth).tolist())


# --- drawing -----------------------------------------------------------------------------------------------

def test_draws_are_inverse_cdf_of_the_seeded_uniforms() -> None:
    """Token = the first index whose cumulative probability reaches u, u from default_rng(seed).random."""
    logits = np.log(np.array([[0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25], [0.7, 0.1, 0.1, 0.1]]))
    sampler = Sampler(SamplingParams(temperature=1.0, seed=123))
    rng = np.random.default_rng(123)
    cdf = np.cumsum(np.exp(logits), axis=-1)
    for _ in range(50):
        u = rng.random(3)
        want = [int(np.searchsorted(cdf[i], u[i], side="left")) for i in range(3)]
        assert sampler(logits).tolist() == want


def test_empirical_frequencies_match_the_filtered_distribution() -> None:
    p = [0.05, 0.5, 0.2, 0.25]
    sampler = Sampler(SamplingParams(temperature=1.0, top_p=0.9, seed=0))  # keeps {1, 3, 2}
    n = 20_000
    draws = sampler(np.tile(from_probs(p), (n, 1)))
    counts = np.bincount(draws, minlength=4)
    want = renormalized(p, {1, 2, 3})
    assert counts[0] == 0
    sigma = np.sqrt(n * want * (1 - want))
    assert np.all(np.abs(counts - n * want) <= 5 * sigma + 1e-9), (counts, n * want)


# --- properties --------------------------------------------------------------------------------------------

finite = st.floats(-30.0, 30.0, allow_nan=False, allow_infinity=False)
logit = st.one_of(finite, finite, finite, st.just(-math.inf))  # some tokens banned outright


@given(rows=st.integers(1, 4).flatmap(lambda b: st.integers(1, 40).flatmap(
           lambda v: st.lists(st.lists(logit, min_size=v, max_size=v), min_size=b, max_size=b))),
       temperature=st.floats(0.05, 5.0), top_k=st.integers(-1, 45),
       top_p=st.floats(0.01, 1.0, exclude_min=False), min_p=st.floats(0.0, 1.0),
       seed=st.integers(0, 2**32 - 1))
def test_sampled_token_lies_in_the_filtered_support(rows, temperature, top_k, top_p, min_p, seed) -> None:
    logits = np.array(rows, dtype=float)
    assume(np.isfinite(logits).any(axis=-1).all())
    sampler = Sampler(SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                     seed=seed))
    probs = sampler.probabilities(logits)
    assert not np.isnan(probs).any()
    assert np.all(probs >= 0)
    np.testing.assert_allclose(probs.sum(axis=-1), 1.0, rtol=0, atol=1e-12)
    tokens = sampler(logits)
    assert tokens.dtype == np.int64 and tokens.shape == (len(rows),)
    for row, prob, token in zip(logits, probs, tokens):
        support = np.flatnonzero(prob > 0)
        assert prob[token] > 0, (token, prob)
        base = np.exp(row / temperature - np.max(row / temperature))  # unfiltered, unnormalized
        assert base[support].max() == base.max()  # a most likely token always survives every filter
        assert np.all(np.isfinite(row[support]))  # a banned token is never kept
        if 0 < top_k < row.size:
            kth = np.sort(row)[-top_k]
            assert np.all(row[support] >= kth)  # only tokens at or above the k-th logit
        # min-p: every kept probability is >= min_p * the largest (relative, not absolute)
        assert np.all(prob[support] >= min_p * prob.max() * (1 - 1e-9))
        # renormalization keeps the ratios of the kept tokens: they equal softmax ratios
        scaled = row[support] / temperature
        want = np.exp(scaled - scaled.max())
        np.testing.assert_allclose(prob[support], want / want.sum(), rtol=1e-9, atol=1e-15)


@given(probs=st.lists(st.floats(0.001, 1.0), min_size=2, max_size=30), top_p=st.floats(0.01, 1.0))
def test_top_p_support_is_the_minimal_prefix_reaching_top_p(probs, top_p) -> None:
    """Against an independent loop: walk tokens by descending probability until the mass reaches top_p."""
    p = np.array(probs) / sum(probs)
    got = probs_of(from_probs(p), top_p=top_p)
    order = sorted(range(len(p)), key=lambda i: (-p[i], i))
    mass, keep = 0.0, set()
    for i in order:
        keep.add(i)
        mass += p[i]
        if mass >= top_p:
            break
    # the two sides accumulate in different orders; skip draws that sit within rounding of the boundary
    prefix = np.cumsum(p[order])
    assume(np.all(np.abs(prefix - top_p) > 1e-9))
    assume(len({p[i] for i in order}) == len(order))  # tied probabilities may be ordered either way
    assert set(np.flatnonzero(got > 0).tolist()) == keep


@given(st.lists(st.sampled_from([0.0, 0.7, 1.3]), min_size=1, max_size=9), st.integers(0, 2**16),
       st.integers(2, 40))
def test_one_call_for_a_step_draws_what_each_row_draws_alone(temperatures, seed, vocab):
    """The engine samples a step's rows in one call: greedy rows through one argmax, each seeded row through
    its own generator, so every row gets the token its sampler gives it alone, three steps running."""
    rng = np.random.default_rng(seed)
    params = [SamplingParams(temperature=t, top_k=3 if i % 2 else 0, seed=seed + i)
              for i, t in enumerate(temperatures)]
    batched, alone = [Sampler(p) for p in params], [Sampler(p) for p in params]
    for _ in range(3):
        logits = rng.normal(size=(len(params), vocab)) * 3
        expected = [int(sampler(logits[i:i + 1])[0]) for i, sampler in enumerate(alone)]
        assert sample_rows(batched, logits).tolist() == expected
