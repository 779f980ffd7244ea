"""The Python API against wrong types, NaN/inf, negatives, huge, empty and ragged arguments.

Every call must raise a KVLabError subclass naming the argument, and leave the caller's cache (and, for
sessions, the session and its file) exactly as it was. Hypothesis draws the bad values.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlab
from adversarial import TALLY, cache_state, refuses, tree_state
from kvlab import validate
from kvlab.sampling.sampler import SamplingParams
from kvlab.errors import InputError
from kvlab.model.weights import random_weights
from kvlab.perplexity import perplexity
from kvlab.verify import verify_model

MODEL = kvlab.TinyLlama(seed=7, max_position_embeddings=32)
VOCAB = MODEL.config.vocab_size

NON_FINITE = st.sampled_from([math.nan, math.inf, -math.inf, np.float32("nan"), np.float64("inf")])
NOT_A_NUMBER = st.one_of(st.none(), st.booleans(), st.text(max_size=4), st.binary(max_size=2),
                         st.lists(st.floats(allow_nan=False), max_size=2), st.complex_numbers(max_magnitude=2),
                         st.just(np.array([0.5])), st.just(np.bool_(True)), st.just(object()))
NOT_AN_INT = st.one_of(NOT_A_NUMBER, st.floats(allow_nan=True), NON_FINITE)
HUGE = st.integers(min_value=2**64, max_value=2**200)

BAD_SAMPLING = {
    "temperature": st.one_of(NOT_A_NUMBER, NON_FINITE, st.floats(max_value=-1e-300),
                             st.floats(min_value=5e-324, max_value=9.99e-6), st.just(1e400)),
    "top_p": st.one_of(NOT_A_NUMBER, NON_FINITE, st.floats(max_value=0.0), st.floats(min_value=1.0000001)),
    "min_p": st.one_of(NOT_A_NUMBER, NON_FINITE, st.floats(max_value=-1e-300), st.floats(min_value=1.0000001)),
    "top_k": st.one_of(NOT_AN_INT, st.integers(max_value=-2)),
    "seed": st.one_of(st.booleans(), st.text(max_size=3), st.floats(allow_nan=True), st.integers(max_value=-2),
                      HUGE),
}


def prefilled():
    return MODEL.forward(np.array([[1, 2, 3]]), use_cache=True).cache


@pytest.mark.parametrize("field", sorted(BAD_SAMPLING))
@settings(max_examples=25)
@given(data=st.data())
def test_bad_sampling_values_are_refused_before_the_cache_grows(field, data):
    value = data.draw(BAD_SAMPLING[field], label=field)
    refuses(lambda: SamplingParams(**{field: value}), InputError, match=field)
    cache = prefilled()
    before = cache_state(cache)
    refuses(lambda: kvlab.generate(MODEL, [[4]], 2, cache=cache, **{"temperature": 1.0, field: value}))
    assert cache_state(cache) == before


BAD_GENERATE = {
    "max_new_tokens": st.one_of(st.booleans(), st.text(max_size=2), st.floats(allow_nan=True),
                                st.integers(max_value=-1), st.integers(min_value=40, max_value=10**30)),
    "stop_token_ids": st.one_of(st.text(min_size=1, max_size=3), st.floats(), st.integers(max_value=-1),
                                st.integers(min_value=VOCAB), st.just({1: 2}),
                                st.lists(st.one_of(st.none(), st.floats(), st.text(max_size=1),
                                                   st.integers(max_value=-1), st.integers(min_value=VOCAB),
                                                   st.lists(st.integers(0, 5), max_size=2)),
                                         min_size=1, max_size=3)),
    "pad_token_id": st.one_of(st.booleans(), st.floats(), st.text(max_size=2), st.integers(max_value=-1),
                              st.integers(min_value=VOCAB)),
    "use_cache": st.one_of(st.none(), st.integers(), st.text(max_size=2), st.just(False)),  # False + cache
    "kv_dtype": st.one_of(st.sampled_from(["int3", "float8", "", "float32x", "int8"]), st.integers(),
                          st.just("float16")),  # float16 contradicts the float64 cache it is given with
}


@pytest.mark.parametrize("argument", sorted(BAD_GENERATE))
@settings(max_examples=25)
@given(data=st.data())
def test_bad_generate_arguments_leave_the_cache(argument, data):
    value = data.draw(BAD_GENERATE[argument], label=argument)
    cache = prefilled()
    before = cache_state(cache)
    kwargs = {"cache": cache, argument: value}
    if argument == "pad_token_id":
        kwargs["stop_token_ids"] = [5]
    n = kwargs.pop("max_new_tokens", 3)
    refuses(lambda: kvlab.generate(MODEL, [[4]], n, **kwargs))
    assert cache_state(cache) == before


BAD_SEQUENCES = st.one_of(  # bad as a batch [B, T] and as one session sequence
    st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=3), min_size=2, max_size=3).filter(
        lambda rows: len({len(r) for r in rows}) > 1),  # ragged
    st.just([]), st.just([[]]),
    st.just([[[1, 2]]]), st.lists(st.lists(st.floats(), min_size=1, max_size=3), min_size=1, max_size=1),
    st.lists(st.lists(st.integers(max_value=-1), min_size=1, max_size=2), min_size=1, max_size=1),
    st.lists(st.lists(st.integers(min_value=VOCAB, max_value=2**62), min_size=1, max_size=2), min_size=1,
             max_size=1),
    st.text(max_size=4), st.none(), st.just([[True, False]]), st.just(np.zeros((1, 40), dtype=np.int64)),
)
BAD_IDS = st.one_of(BAD_SEQUENCES, st.lists(st.integers(0, 5), min_size=1, max_size=3))  # + 1-D for a batch


@settings(max_examples=40)
@given(ids=BAD_IDS)
def test_bad_ids_leave_the_cache(ids):
    cache = prefilled()
    before = cache_state(cache)
    refuses(lambda: MODEL.forward(ids, cache=cache))
    refuses(lambda: kvlab.generate(MODEL, ids, 2, cache=cache))
    assert cache_state(cache) == before


def test_cache_with_use_cache_false_is_refused():
    """Before: accepted, then ignored (the tail was recomputed from position 0: other tokens)."""
    cache = prefilled()
    before = cache_state(cache)
    refuses(lambda: kvlab.generate(MODEL, [[4]], 3, cache=cache, use_cache=False), match="use_cache=False")
    assert cache_state(cache) == before


def test_negative_stop_id_never_becomes_the_pad():
    cache = prefilled()
    before = cache_state(cache)
    refuses(lambda: kvlab.generate(MODEL, [[4], [5]], 3, stop_token_ids=[-1, 7]), match="stop_token_ids")
    refuses(lambda: kvlab.generate(MODEL, [[4]], 3, cache=cache, pad_token_id=VOCAB, stop_token_ids=[7]))
    assert cache_state(cache) == before


def test_a_single_stop_id_is_one_id():
    """`stop_token_ids=257` (an int, as HF's eos_token_id) means [257]; the same tokens as the list form."""
    one = kvlab.generate(MODEL, [[1, 2]], 6, stop_token_ids=257)
    listed = kvlab.generate(MODEL, [[1, 2]], 6, stop_token_ids=[257])
    np.testing.assert_array_equal(one, listed)


@settings(max_examples=25)
@given(batch=st.one_of(NOT_AN_INT, st.integers(max_value=0), HUGE),
       capacity=st.one_of(st.just(16), st.floats(), st.integers(max_value=-1), st.text(max_size=2)))
def test_new_cache_refuses_bad_sizes(batch, capacity):
    refuses(lambda: MODEL.new_cache(batch))
    if not isinstance(capacity, int) or capacity < 0:
        refuses(lambda: MODEL.new_cache(1, capacity=capacity))


# --- sessions ------------------------------------------------------------------------------------------
BAD_EXTRA = st.one_of(
    st.none(), st.lists(st.integers(), max_size=2), st.text(max_size=3), st.integers(),
    st.just({"t": (1, 2)}), st.just({1: "int key"}), st.just({"x": math.nan}), st.just({"x": math.inf}),
    st.just({"s": {1, 2}}), st.just({"o": object()}), st.just({"b": b"bytes"}), st.just({"n": {2: 3}}),
    st.just({"a": np.float32(1.0)}),
)


@settings(max_examples=30)
@given(extra=BAD_EXTRA)
def test_session_extra_that_cannot_load_is_never_saved(extra, tmp_path_factory):
    folder = tmp_path_factory.mktemp("session")
    session = kvlab.Session(MODEL)
    session.feed([1, 2, 3])
    session.save(folder / "s.kvs")
    files = tree_state(folder)
    session.extra = extra
    refuses(lambda: session.save(folder / "s.kvs"), InputError, match="extra")
    refuses(lambda: session.save(folder / "new.kvs"), InputError, match="extra")
    assert tree_state(folder) == files
    assert kvlab.Session.load(folder / "s.kvs", MODEL).tokens == [1, 2, 3]


@settings(max_examples=30)
@given(field=st.sampled_from(sorted(BAD_SAMPLING) + ["stop_token_ids", "max_new_tokens"]), data=st.data())
def test_session_stream_refuses_before_it_moves(field, data):
    session = kvlab.Session(MODEL)
    session.feed([1, 2, 3])
    before = (session.tokens, cache_state(session.cache))
    strategy = BAD_SAMPLING[field] if field in BAD_SAMPLING else BAD_GENERATE[field]
    value = data.draw(strategy, label=field)
    if field == "max_new_tokens":
        refuses(lambda: session.stream(value))
    else:
        refuses(lambda: session.stream(2, **{"temperature": 1.0, field: value}))
    assert (session.tokens, cache_state(session.cache)) == before


@settings(max_examples=30)
@given(tokens=BAD_SEQUENCES)
def test_session_feed_refuses_bad_tokens(tokens):
    session = kvlab.Session(MODEL)
    session.feed([1, 2, 3])
    before = (session.tokens, cache_state(session.cache))
    refuses(lambda: session.feed(tokens))
    assert (session.tokens, cache_state(session.cache)) == before


@pytest.mark.parametrize("path", ["folder", "loop", "missing", "binary"])
def test_session_load_refuses_bad_paths(path, tmp_path):
    (tmp_path / "folder").mkdir()
    (tmp_path / "binary").write_bytes(b"\x00\xff" * 40)
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    before = tree_state(tmp_path)
    refuses(lambda: kvlab.Session.load(tmp_path / path, MODEL))
    assert tree_state(tmp_path) == before


# --- layers --------------------------------------------------------------------------------------------
def attention_inputs(rng, keys=5, new=2):
    q = rng.standard_normal((1, 4, new, 8))
    k = rng.standard_normal((1, 2, keys, 8))
    return q, k, k.copy(), np.arange(keys - new, keys), np.arange(keys)


BAD_ATTENTION = [
    ("fewer key positions than keys", lambda q, k, v, qp, kp: (q, k, v, qp, kp[:-1])),
    ("more key positions than keys", lambda q, k, v, qp, kp: (q, k, v, qp, np.arange(k.shape[2] + 1))),
    ("query positions per key", lambda q, k, v, qp, kp: (q, k, v, kp, kp)),
    ("k and v differ", lambda q, k, v, qp, kp: (q, k, v[:, :, :-1], qp, kp)),
    ("head_dim differs", lambda q, k, v, qp, kp: (q[..., :4], k, v, qp, kp)),
    ("batch differs", lambda q, k, v, qp, kp: (np.concatenate([q, q]), k, v, qp, kp)),
    ("heads not a multiple", lambda q, k, v, qp, kp: (q[:, :3], k, v, qp, kp)),
    ("3-D q", lambda q, k, v, qp, kp: (q[0], k, v, qp, kp)),
    ("float positions", lambda q, k, v, qp, kp: (q, k, v, qp.astype(float), kp)),
    ("int q", lambda q, k, v, qp, kp: (q.astype(int), k, v, qp, kp)),
    ("list k", lambda q, k, v, qp, kp: (q, k.tolist(), v, qp, kp)),
]


@pytest.mark.parametrize("label,bend", BAD_ATTENTION, ids=[b[0] for b in BAD_ATTENTION])
def test_grouped_attention_refuses_inconsistent_shapes(label, bend):
    q, k, v, qp, kp = bend(*attention_inputs(np.random.default_rng(0)))
    refuses(lambda: kvlab.grouped_attention(q, k, v, query_positions=qp, key_positions=kp), InputError)


@pytest.mark.parametrize("x,positions", [
    (np.zeros((1, 2, 3, 8)), np.arange(4)), (np.zeros((1, 2, 3, 8)), np.arange(3.0)),
    (np.zeros((1, 2, 3, 7)), np.arange(3)), (np.zeros((2, 2, 3, 8)), np.zeros((3, 3), dtype=int)),
    (np.zeros((1, 2, 3, 8), dtype=int), np.arange(3)), (np.zeros(8), np.arange(1)),
])
def test_apply_rope_refuses_mismatched_positions(x, positions):
    refuses(lambda: kvlab.apply_rope(x, positions), InputError)


# --- configs, perplexity, verify, sizes ------------------------------------------------------------------
CONFIG_FIELDS = {
    "vocab_size": [0, -1, 1.5, "10", None, True, [10]],
    "hidden_size": [0, 7.0, "32", None],
    "num_attention_heads": [0, 3, None, 4.0],
    "num_key_value_heads": [0, 3, -2, "2"],
    "head_dim": [0, 7, -8, 8.0],
    "max_position_embeddings": [0, -1, None, 2.5],
    "rms_norm_eps": [0.0, -1e-6, math.nan, math.inf, "1e-6", None, 5e-324],
    "rope_theta": [0, 0.0, -10000.0, math.nan, math.inf, "10000", None, [1.0], 1e-320],
    "rope_scaling": [[1], "linear", {"rope_type": "linear", "factor": 0}, {"rope_type": "linear"},
                     {"rope_type": "linear", "factor": -2.0}, {"rope_type": "linear", "factor": math.nan},
                     {"rope_type": "yarn", "factor": 2.0},
                     {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0,
                      "original_max_position_embeddings": 8192},
                     {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 0}],
    "tie_word_embeddings": ["false", "true", 0, 1, None],
    "attention_bias": ["no", 1, None],
    "causal": ["yes", 0],
    "sliding_window": [0, -4, 4.5, True, "4"],
    "bos_token_id": [-1, 1.0, "1", True],
    "eos_token_id": [-1, "2", [1, "2"], [], [-3], 2.0, {"id": 2}],
    "architecture": ["GPT2LMHeadModel", None, 5],
}


@pytest.mark.parametrize("field,value", [(f, v) for f, vs in CONFIG_FIELDS.items() for v in vs],
                         ids=[f"{f}={v!r}"[:60] for f, vs in CONFIG_FIELDS.items() for v in vs])
def test_config_fields_are_refused_by_name(field, value):
    from kvlab.errors import ConfigError

    error = refuses(lambda: kvlab.ModelConfig(**{field: value}), ConfigError)
    assert field.split("_token")[0] in str(error) or "rope" in str(error), str(error)


@settings(max_examples=30)
@given(argument=st.sampled_from(["context", "stride", "chunk", "bos_token_id", "token_ids"]), data=st.data())
def test_perplexity_refuses_bad_arguments(argument, data):
    bad = {"token_ids": st.one_of(st.just([]), st.text(max_size=3), st.lists(st.floats(), min_size=1, max_size=2),
                                  st.lists(st.integers(min_value=VOCAB), min_size=1, max_size=2)),
           "bos_token_id": st.one_of(st.none(), st.integers(max_value=-1), st.integers(min_value=VOCAB),
                                     st.floats())}.get(argument, st.one_of(st.integers(max_value=0), NOT_AN_INT
                                                                         .filter(lambda v: v is not None)))
    value = data.draw(bad, label=argument)
    kwargs = {"token_ids": [1, 2, 3, 4], "bos_token_id": 256, argument: value}
    refuses(lambda: perplexity(MODEL, **kwargs))


@pytest.mark.parametrize("kwargs", [{"tolerance": math.nan}, {"tolerance": -1.0}, {"tolerance": "1e-4"},
                                    {"length": 1}, {"length": -3}, {"length": 2.5}, {"seed": -1},
                                    {"seed": "x"}])
def test_verify_refuses_bad_arguments(kwargs):
    refuses(lambda: verify_model(MODEL, **kwargs))


@settings(max_examples=40)
@given(text=st.one_of(st.text(max_size=8).filter(lambda t: not validate.values._SIZE.fullmatch(t)),
                      st.sampled_from(["1e400", "nan", "inf", "-1", "-5GiB", "9e18GB", "1e19", "8 XiB", "GiB"]),
                      st.floats(allow_nan=True), st.none(), st.booleans(), st.integers(max_value=-1)))
def test_parse_size_refuses_what_is_not_a_byte_count(text):
    refuses(lambda: validate.parse_size(text))


@pytest.mark.parametrize("text,want", [("64MiB", 64 * 2**20), ("8GiB", 8 * 2**30), ("8 GB", 8 * 10**9),
                                       ("512mb", 512 * 10**6), ("1.5KiB", 1536), ("1e9", 10**9),
                                       (" 1000000 ", 10**6), (4096, 4096), ("2k", 2000), ("1TiB", 2**40)])
def test_parse_size_reads_binary_and_decimal_units(text, want):
    assert validate.parse_size(text) == want


TOKENIZER = kvlab.ByteTokenizer()


@pytest.mark.parametrize("label,call", [
    ("encode an int", lambda: TOKENIZER.encode(5)),
    ("encode bytes", lambda: TOKENIZER.encode(b"abc")),
    ("encode a lone surrogate", lambda: TOKENIZER.encode("a\udcff")),
    ("decode -1", lambda: TOKENIZER.decode([-1])),
    ("decode past the vocabulary", lambda: TOKENIZER.decode([VOCAB])),
    ("decode a str", lambda: TOKENIZER.decode("ab")),
    ("decode floats", lambda: TOKENIZER.decode([1.5])),
    ("model dtype name", lambda: kvlab.LlamaModel(kvlab.tiny_config(), dtype="foo")),
    ("model dtype float16", lambda: kvlab.LlamaModel(kvlab.tiny_config(), dtype="float16")),
    ("model config a dict", lambda: kvlab.LlamaModel({"vocab_size": 5})),
    ("weights of strings", lambda: kvlab.LlamaModel(kvlab.tiny_config(), weights={
        k: v.astype(str) for k, v in random_weights(kvlab.tiny_config()).items()})),
    ("weights of ints", lambda: kvlab.LlamaModel(kvlab.tiny_config(), weights={
        k: v.astype(np.int32) for k, v in random_weights(kvlab.tiny_config()).items()})),
    ("TinyLlama seed -1", lambda: kvlab.TinyLlama(seed=-1)),
    ("TinyLlama seed 1.5", lambda: kvlab.TinyLlama(seed=1.5)),
    ("forward logits_to_keep=True", lambda: MODEL.forward([[1]], logits_to_keep=True)),
    ("session load None", lambda: kvlab.Session.load(None, MODEL)),
    ("session save None", lambda: kvlab.Session(MODEL).save(None)),
    ("config from a list", lambda: kvlab.ModelConfig.from_hf_dict([1])),
    ("config file None", lambda: kvlab.ModelConfig.from_file(None)),
    ("config file missing", lambda: kvlab.ModelConfig.from_file("/no/such/config.json")),
    ("kv bytes of int3", lambda: kvlab.kv_bytes_per_token(kvlab.tiny_config(), "int3")),
    ("load a number", lambda: kvlab.load(5)),
    ("load dtype foo", lambda: kvlab.load(None, dtype="foo")),
])
def test_odd_argument_types(label, call):
    refuses(call)


def test_the_tally_counts_every_refusal():
    """Not a bad input itself: the helpers count, so the note's numbers come from the suite."""
    tried = TALLY["tried"]
    refuses(lambda: validate.int_in_range(True, "x"))
    assert TALLY["tried"] == tried + 1 and TALLY["clean"] >= 1
    assert isinstance(Path(__file__), Path)
