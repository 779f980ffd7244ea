"""Prefix matching against an independent reference, and the turns where an off-by-one would hide.

The expected reuse is never computed with the function under test: `common_prefix_reference` walks both
sequences by hand. The session turns include changing the last cached token and then appending, where
reusing one row too many gives stale logits and one too few still gives the right numbers (so the reuse
count itself is checked).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from references import common_prefix_reference

from kvlab import ContextLengthError, InputError, Session, TinyLlama
from kvlab.sessions import common_prefix_length

TOL = 1e-10  # float64 cached vs uncached logits: measured differences are ~1e-15
MODEL = TinyLlama(seed=7)  # vocab 260


@pytest.mark.parametrize("cached,tokens,want", [
    ([], [], 0), ([], [1], 0), ([1], [], 0),
    ([5], [5], 1), ([5], [6], 0), ([5], [5, 6], 1), ([5, 6], [5], 1),
    ([1, 2, 3], [1, 2, 3], 3), ([1, 2, 3], [1, 2, 4], 2), ([1, 2, 3], [9, 2, 3], 0),
    ([1, 2, 3, 4], [1, 9, 3, 4], 1),  # ids that match again after a difference do not count
    ([0, 0, 0], [0, 0, 0, 0, 0], 3),
])
def test_hand_computed_prefix_lengths(cached, tokens, want) -> None:
    assert common_prefix_length(cached, tokens) == want
    got = common_prefix_length(np.array(cached, dtype=np.int64), np.array(tokens, dtype=np.int64))
    assert got == want and type(got) is int


@given(data=st.data(), alphabet=st.integers(1, 4), n=st.integers(0, 64))
def test_matches_the_reference_on_random_sequences(data, alphabet, n) -> None:
    # a tiny alphabet and a shared stem make long common prefixes (and late differences) likely
    stem = data.draw(st.lists(st.integers(0, alphabet), min_size=n, max_size=n))
    a = stem + data.draw(st.lists(st.integers(0, alphabet), max_size=8))
    b = stem[: data.draw(st.integers(0, n))] + data.draw(st.lists(st.integers(0, 2**40), max_size=8))
    assert common_prefix_length(a, b) == common_prefix_reference(a, b) == common_prefix_length(b, a)


def feed_and_check(session: Session, tokens: list[int], reused: int) -> None:
    before = session.tokens
    turn = session.feed(tokens)
    assert reused == min(common_prefix_reference(before, tokens), len(tokens) - 1)  # the test's own claim
    assert (turn.tokens, turn.reused, turn.computed) == (len(tokens), reused, len(tokens) - reused)
    want = MODEL.forward(np.array([tokens])).logits[0, -1]
    np.testing.assert_allclose(turn.logits, want, rtol=0, atol=TOL)
    assert session.tokens == tokens and session.cache.get_seq_length() == len(tokens)


@pytest.mark.parametrize("appended", [[], [4], [4, 11, 12]])
def test_changing_the_last_cached_token_then_appending(appended: list[int]) -> None:
    session = Session(MODEL)
    history = [3, 14, 15, 92, 65, 35]
    feed_and_check(session, history, 0)
    changed = history[:-1] + [89] + appended  # the last cached row (token 35) is stale now
    feed_and_check(session, changed, 5)
    # and back: the row for 89 is replaced by the original last token again
    feed_and_check(session, history + [7], 5)


def test_appending_to_a_single_token_and_replacing_it() -> None:
    session = Session(MODEL)
    feed_and_check(session, [42], 0)
    feed_and_check(session, [42, 43], 1)
    feed_and_check(session, [41, 43], 0)
    feed_and_check(session, [41], 0)  # a prefix of what is cached: the last token is recomputed


@given(turns=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=64), min_size=2, max_size=5))
def test_session_reuse_equals_the_reference_on_random_turns(turns) -> None:
    session = Session(MODEL)
    before: list[int] = []
    for tokens in turns:
        turn = session.feed(tokens)
        assert turn.reused == min(common_prefix_reference(before, tokens), len(tokens) - 1)
        np.testing.assert_allclose(turn.logits, MODEL.forward(np.array([tokens])).logits[0, -1], rtol=0,
                                   atol=TOL)
        before = tokens


def test_a_session_may_fill_the_whole_context_and_save_it(tmp_path) -> None:
    model = TinyLlama(seed=7, max_position_embeddings=16)
    session = Session(model)
    turn = session.feed(list(range(16)))  # exactly the context: allowed
    assert turn.tokens == 16 and isinstance(turn.seconds, float) and 0 < turn.seconds < 60
    session.save(tmp_path / "full.kvc")
    assert Session.load(tmp_path / "full.kvc", model).tokens == list(range(16))
    with pytest.raises(ContextLengthError, match="^17 tokens exceed the model's context of 16 tokens"):
        session.feed(list(range(17)))
    for bad, message in [([], "^the token sequence is empty: a turn needs at least one token$"),
                         ([[1, 2], [3, 4]], r"^a session holds one sequence: give 1-D token ids, got shape "
                                            r"\(2, 2\)$"),
                         ([[1, 2], [3]], r"^token ids must be a flat sequence of ints \(")]:
        with pytest.raises(InputError, match=message):
            session.feed(bad)
    assert session.tokens == list(range(16))
