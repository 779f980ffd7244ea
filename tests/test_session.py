"""Session: a cache kept across chat turns reuses exactly the unchanged prefix and stays exact."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from references import common_prefix_reference

import kvlab
from kvlab import CacheMismatchError, ContextLengthError, InputError, Session, TinyLlama, generate
from kvlab.model.weights import random_weights

TOL = 1e-10
# The seed's practice: prompt + reply (8 tokens), then a new message appended, then the third token edited.
TURN1 = [1, 7, 7, 3, 9, 4, 2, 8]
TURN2 = TURN1 + [5, 6, 3, 1, 2]
EDITED = [1, 7, 0, 3, 9, 4, 2, 8, 5, 6, 3, 1, 2]


@pytest.fixture(scope="module")
def model() -> TinyLlama:
    return TinyLlama(seed=7)


def full_logits(model: TinyLlama, tokens: list[int]) -> np.ndarray:
    """The reference: the whole sequence recomputed without any cache."""
    return model.forward(np.array([tokens])).logits[0, -1]


def snapshot(session: Session) -> tuple:
    keys = [np.array(k) for k, _ in session.cache]
    values = [np.array(v) for _, v in session.cache]
    logits = session.logits
    return (session.tokens, session.cache.get_seq_length(), session.cache.positions.tolist(), keys, values,
            None if logits is None else logits.tolist())


def assert_same(a: tuple, b: tuple) -> None:
    assert a[:3] == b[:3] and a[5] == b[5]
    for x, y in zip(a[3] + a[4], b[3] + b[4]):
        np.testing.assert_array_equal(x, y)


def test_exported() -> None:
    assert kvlab.Session is Session


def test_seed_practice_numbers_on_the_real_cache(model: TinyLlama) -> None:
    session = Session(model)
    row_bytes = 2 * 2 * 2 * 8 * 8  # K+V, 2 layers, 2 KV heads, head_dim 8, float64
    rows = []
    for tokens, expected in [(TURN1, (8, 0, 8)), (TURN2, (13, 8, 5)), (EDITED, (13, 2, 11))]:
        turn = session.feed(tokens)
        assert (turn.tokens, turn.reused, turn.computed) == expected
        assert turn.payload_bytes == turn.tokens * row_bytes == session.memory_report().payload_bytes
        assert turn.logits.shape == (model.config.vocab_size,)
        np.testing.assert_allclose(turn.logits, full_logits(model, tokens), rtol=0, atol=TOL)
        rows.append(turn.computed)
    assert rows == [8, 5, 11]
    assert session.tokens == EDITED and session.cache.positions.tolist() == list(range(13))


@pytest.mark.parametrize("k", [0, 1, 2, 5, 12])
def test_editing_token_k_keeps_exactly_k_rows(model: TinyLlama, k: int) -> None:
    session = Session(model)
    session.feed(TURN2)
    edited = list(TURN2)
    edited[k] = (edited[k] + 1) % 256
    turn = session.feed(edited)
    assert (turn.reused, turn.computed) == (k, 13 - k)
    np.testing.assert_allclose(turn.logits, full_logits(model, edited), rtol=0, atol=TOL)


def test_trimming_the_front_keeps_nothing(model: TinyLlama) -> None:
    session = Session(model)
    session.feed(TURN2)
    turn = session.feed(TURN2[4:])
    assert (turn.tokens, turn.reused, turn.computed) == (9, 0, 9)
    np.testing.assert_allclose(turn.logits, full_logits(model, TURN2[4:]), rtol=0, atol=TOL)


def test_identical_sequence_recomputes_its_last_token(model: TinyLlama) -> None:
    """Logits come from a forward, so a fully cached sequence still computes one token (nano-vllm #144)."""
    session = Session(model)
    first = session.feed(TURN2)
    again = session.feed(TURN2)
    assert (again.reused, again.computed) == (12, 1)
    np.testing.assert_allclose(again.logits, first.logits, rtol=0, atol=TOL)


def test_shorter_prefix_crops_and_recomputes_the_new_last_token(model: TinyLlama) -> None:
    session = Session(model)
    session.feed(TURN2)
    turn = session.feed(TURN2[:5])
    assert (turn.reused, turn.computed) == (4, 1)
    assert session.cache.get_seq_length() == 5
    np.testing.assert_allclose(turn.logits, full_logits(model, TURN2[:5]), rtol=0, atol=TOL)


def test_accepts_arrays_and_batch_of_one(model: TinyLlama) -> None:
    session = Session(model)
    assert session.feed(np.array(TURN1, dtype=np.int32)).computed == 8
    assert session.feed(np.array([TURN2])).reused == 8


@pytest.mark.parametrize("bad, error", [
    ([1, 2, 260], InputError),                  # past the vocabulary
    ([1, -1, 2], InputError),                   # negative
    ([], InputError),                           # empty
    ([[1, 2], [3, 4]], InputError),             # a batch of two
    ([1.0, 2.0], InputError),                   # not ints
    ([True, False], InputError),                # bools are not token ids
    ([[1, 2], [3]], InputError),                # ragged
    ([1] * 2049, ContextLengthError),           # longer than the context
    ("hello", InputError),                      # text, not ids
])
def test_bad_input_raises_and_leaves_the_session_as_it_was(model: TinyLlama, bad: object,
                                                           error: type) -> None:
    session = Session(model)
    session.feed(TURN2)
    before = snapshot(session)
    with pytest.raises(error):
        session.feed(bad)
    assert_same(snapshot(session), before)
    turn = session.feed(TURN2 + [4])  # and the session still works
    assert (turn.reused, turn.computed) == (13, 1)


def test_changed_weights_are_refused_before_anything_is_cropped() -> None:
    model = TinyLlama(seed=7)
    session = Session(model)
    session.feed(TURN2)
    before = snapshot(session)
    model.set_weights(random_weights(model.config, 8, model.dtype))
    with pytest.raises(CacheMismatchError):
        session.feed(EDITED)
    with pytest.raises(CacheMismatchError):
        session.stream(3)
    assert_same(snapshot(session), before)


def test_interrupted_forward_leaves_a_consistent_smaller_session(model: TinyLlama,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    session = Session(model)
    session.feed(TURN2)
    real = model.forward

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(model, "forward", interrupted)
    with pytest.raises(KeyboardInterrupt):
        session.feed(EDITED)
    assert session.tokens == EDITED[:2] and session.cache.get_seq_length() == 2 and session.logits is None
    monkeypatch.setattr(model, "forward", real)
    turn = session.feed(EDITED)
    assert (turn.reused, turn.computed) == (2, 11)
    np.testing.assert_allclose(turn.logits, full_logits(model, EDITED), rtol=0, atol=TOL)


# --- generation ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.9, "top_k": 50, "seed": 3}])
def test_hit_then_generate_equals_a_cold_run(model: TinyLlama, sampling: dict) -> None:
    """Generation after a prefix hit continues at the right positions (no RoPE restart at 0)."""
    session = Session(model)
    session.feed(TURN1)
    turn = session.feed(TURN2)
    assert turn.reused == 8
    new = session.generate(10, **sampling)
    cold = generate(model, [TURN2], 10, **sampling)[0].tolist()
    assert new == cold
    assert session.tokens == TURN2 + new and session.cache.get_seq_length() == 23
    np.testing.assert_allclose(session.logits, full_logits(model, TURN2 + new), rtol=0, atol=TOL)


def test_generated_tokens_stay_cached_for_the_next_turn(model: TinyLlama) -> None:
    session = Session(model)
    session.feed(TURN1)
    reply = session.generate(6)
    history = TURN1 + reply
    assert session.tokens == history
    turn = session.feed(history + [5, 6, 3])
    assert (turn.reused, turn.computed) == (len(history), 3)
    np.testing.assert_allclose(turn.logits, full_logits(model, history + [5, 6, 3]), rtol=0, atol=TOL)


def test_stop_token_ends_the_stream_and_is_kept(model: TinyLlama) -> None:
    session = Session(model)
    session.feed(TURN1)
    free = session.generate(8)
    session.feed(TURN1)
    stopped = session.generate(8, stop_token_ids=[free[2]])
    assert stopped == free[: free.index(free[2]) + 1]
    assert session.tokens == TURN1 + stopped


def test_stream_is_consistent_when_abandoned(model: TinyLlama) -> None:
    session = Session(model)
    session.feed(TURN1)
    stream = session.stream(10)
    first = [next(stream), next(stream)]
    stream.close()
    assert session.tokens == TURN1 + first and session.cache.get_seq_length() == 10


@pytest.mark.parametrize("call, error, message", [
    (lambda s: s.stream(-1), InputError, r"^max_new_tokens must be .*, got .*-1$"),
    (lambda s: s.stream(2.5), InputError, r"^max_new_tokens must be .*, got .*2\.5$"),
    (lambda s: s.stream(True), InputError, r"^max_new_tokens must be .*, got .*True$"),
    (lambda s: s.stream(2048 - 8 + 1), ContextLengthError,
     "8 cached tokens \\+ 2041 new tokens exceed the model's context of 2048 tokens"),
    (lambda s: s.stream(3, temperature=-1.0), InputError, "temperature must be >= 0"),
])
def test_generation_arguments_are_checked_before_anything_runs(model: TinyLlama, call, error,
                                                                message) -> None:
    session = Session(model)
    session.feed(TURN1)
    before = snapshot(session)
    assert session.context_length == 2048
    session.stream(2048 - 8).close()  # exactly the room left is accepted (nothing runs until next())
    with pytest.raises(error, match=message):
        call(session)
    assert_same(snapshot(session), before)


def test_generation_needs_a_prompt(model: TinyLlama) -> None:
    with pytest.raises(InputError, match="^the session is empty: feed a prompt before generating$"):
        Session(model).stream(3)


def test_generation_runs_to_the_context_end_and_no_further() -> None:
    model = TinyLlama(seed=7, max_position_embeddings=12)
    session = Session(model)
    session.feed(TURN1)
    assert len(session.generate()) == 4 and session.num_cached_tokens == 12
    assert session.generate(0) == []
    with pytest.raises(ContextLengthError):
        session.generate(1)


def test_reset(model: TinyLlama) -> None:
    session = Session(model)
    session.feed(TURN2)
    session.reset()
    assert session.tokens == [] and session.cache.get_seq_length() == 0 and session.logits is None
    assert session.feed(TURN1).computed == 8


# --- random edit sequences -------------------------------------------------------------------------------

token = st.integers(0, 259)
edit = st.one_of(
    st.tuples(st.just("append"), st.lists(token, min_size=1, max_size=24)),
    st.tuples(st.just("replace"), st.integers(0, 63), token),
    st.tuples(st.just("truncate"), st.integers(1, 64)),
    st.tuples(st.just("trim_front"), st.integers(1, 8)),
    st.tuples(st.just("same"),),
    st.tuples(st.just("change_last_then_append"), token, st.lists(token, max_size=4)),
)


@given(start=st.lists(token, min_size=1, max_size=64), edits=st.lists(edit, min_size=1, max_size=6))
def test_random_edit_sequences_stay_exact(model: TinyLlama, start: list[int], edits: list[tuple]) -> None:
    session = Session(model)
    tokens = list(start)
    turns = [session.feed(tokens)]
    expected_reused = [0]
    for op in edits:
        before = list(tokens)
        if op[0] == "append":
            tokens = (tokens + op[1])[: model.config.max_position_embeddings]
        elif op[0] == "change_last_then_append":
            tokens = (tokens[:-1] + [op[1]] + op[2])[: model.config.max_position_embeddings]
        elif op[0] == "replace":
            tokens[op[1] % len(tokens)] = op[2]
        elif op[0] == "truncate":
            tokens = tokens[: max(1, op[1] % (len(tokens) + 1))]
        elif op[0] == "trim_front" and len(tokens) > op[1]:
            tokens = tokens[op[1]:]
        turns.append(session.feed(tokens))
        expected_reused.append(min(common_prefix_reference(before, tokens), len(tokens) - 1))
        turn = turns[-1]
        assert turn.tokens == len(tokens) == turn.reused + turn.computed
        np.testing.assert_allclose(turn.logits, full_logits(model, tokens), rtol=0, atol=TOL)
        assert session.tokens == tokens
        assert session.cache.positions.tolist() == list(range(len(tokens)))
    assert [t.reused for t in turns] == expected_reused
