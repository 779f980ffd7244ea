"""Cache policies: the rows they keep, the positions they move them to, and what the model sees then."""

import numpy as np
import pytest
from hypothesis import given, strategies as st

from kvlab import Engine, InputError, SamplingParams, TinyLlama, apply_rope, generate
from kvlab.cache.kv_cache import KVCache
from kvlab.cache.paged import gather_blocks
from kvlab.errors import ConfigError
from kvlab.model.layers import rotate_halves
from kvlab.policies import AttentionSinks, ContextShift, SlidingWindow, parse_cache_choice, parse_policy
from kvlab.policies.shift import rotate_keys
from kvlab.verify.policy_reference import PolicyCache, greedy_tokens


def model64(dtype=np.float64, **changes):
    return TinyLlama(seed=11, dtype=dtype, max_position_embeddings=64, **changes)


# --- which rows ------------------------------------------------------------------------------------------
@given(st.integers(1, 40), st.integers(0, 6), st.integers(1, 12), st.data())
def test_every_policy_keeps_ascending_rows_within_its_budget(length, sinks, window, data):
    policies = [SlidingWindow(window), AttentionSinks(sinks, window)]
    if sinks < window - 1:
        policies.append(ContextShift(sinks, window))
    for policy in policies:
        num_new = data.draw(st.integers(1, policy.max_chunk))
        if length + num_new <= policy.budget:
            continue
        rows = policy.keep(length, num_new)
        assert rows.size + num_new <= policy.budget
        assert np.all(np.diff(rows) > 0) and (rows.size == 0 or 0 <= rows[0] and rows[-1] < length)
        protected = getattr(policy, "sinks", getattr(policy, "n_keep", 0))
        if rows.size > protected:  # any recent row kept: the newest is one of them
            assert rows[-1] == length - 1


def test_sinks_window_and_shift_choose_the_documented_rows():
    assert AttentionSinks(2, 4).keep(10, 1).tolist() == [0, 1, 7, 8, 9]
    assert SlidingWindow(4).keep(10, 2).tolist() == [8, 9]
    # llama.cpp: n_keep=2 of 10, discard (10 - 2) // 2 = 4 rows after the kept ones
    assert ContextShift(2, 10).keep(10, 1).tolist() == [0, 1, 6, 7, 8, 9]


# --- positions: re-rotation ------------------------------------------------------------------------------
# LongRoPE (Phi-3/4): past the pretraining length (16 here) positions rotate with the long factors, times
# the attention factor; a moved key must turn by its new position's angles minus its old ones
LONGROPE = dict(rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.7],
                              "long_factor": [1.5, 2.0, 3.0, 4.0], "original_max_position_embeddings": 16,
                              "attention_factor": 1.2})


@pytest.mark.parametrize("rope", [{}, LONGROPE], ids=["rope", "longrope"])
@pytest.mark.parametrize("dtype,tol", [(np.float32, 1e-5), (np.float64, 1e-12)])
def test_rotated_keys_equal_keys_computed_at_the_new_positions(dtype, tol, rope):
    rng = np.random.default_rng(0)
    model = TinyLlama(seed=11, dtype=dtype, max_position_embeddings=64, **rope)
    raw = rng.standard_normal((1, 2, 30, 8)).astype(dtype)
    old = rng.integers(0, 64, 30)
    new = rng.integers(0, 64, 30)

    def at(positions):  # the model's own rotation (its RoPE tables: long factors, attention factor)
        cos, sin = model.rope(positions)
        return rotate_halves(raw, cos, sin)

    moved = rotate_keys(at(old), model.rope_tables.angles(new) - model.rope_tables.angles(old))
    fresh = at(new)
    assert moved.dtype == dtype
    assert np.abs(moved - fresh).max() <= tol * np.abs(fresh).max()
    if not rope:  # a plain model's rotation is the seeds' apply_rope
        assert np.abs(fresh - apply_rope(raw, new, inv_freq=model.inv_freq)).max() <= tol * np.abs(fresh).max()


def key_at(model, token: int, position: int) -> np.ndarray:
    """Layer 0's key [H_kv, d] for `token` at `position`, computed afresh: it depends on nothing else (the
    rows before it are zeros)."""
    spec, heads, dim = model.cache_spec, model.config.num_key_value_heads, model.config.head_dim
    zeros = [np.zeros((1, heads, position, dim), model.dtype)] * model.config.num_hidden_layers
    cache = KVCache.from_arrays(spec, zeros, zeros, np.arange(position)) if position else model.new_cache()
    model.forward([[token]], cache=cache)
    return cache[0][0][0, :, position]


@pytest.mark.parametrize("dtype,tol", [(np.float32, 1e-5), (np.float64, 1e-12)])
@pytest.mark.parametrize("kv_dtype", [None, "float16", "int8", "int4"])
@pytest.mark.parametrize("make_policy", [lambda: ContextShift(3, 20), lambda: AttentionSinks(2, 14)])
@pytest.mark.parametrize("rope", [{}, LONGROPE], ids=["rope", "longrope"])
def test_after_many_evictions_every_visible_key_is_its_token_rotated_once(dtype, tol, kv_dtype, make_policy, rope):
    """llama.cpp #5652 / #4097: after many shifts every kept key must still be a pure rotation. The engine
    keeps the tail where it was computed and writes the prefix rows, rotated from the originals, right before
    it at every step: after ~130 evictions each visible key of layer 0 is its token's key at its place,
    with at most two roundings (the original's, and the rotated copy's), never one per eviction."""
    model = TinyLlama(seed=11, dtype=dtype, max_position_embeddings=256, **rope)  # room for key_at's positions
    stream = np.random.default_rng(1).integers(0, 256, 150).tolist()
    policy = make_policy()
    engine = Engine(model, block_size=4, num_blocks=16, max_num_batched_tokens=1, kv_policy=policy,
                    kv_cache_dtype=kv_dtype, enable_prefix_caching=False)
    engine.add_request("r", stream, SamplingParams(max_tokens=2, ignore_eos=True))
    seq = engine.scheduler.waiting[0]
    while seq.num_computed_tokens < len(stream):
        engine.step()
    view = seq.kv_view
    assert view.view_start > 100 and view.prefix == getattr(policy, "sinks", getattr(policy, "n_keep", 0))
    pool = engine.block_pool
    table = np.array([[0 if b < 0 else b for b in seq.block_table]])
    keys = gather_blocks(pool.key_cache[0], table, len(stream))[0]
    positions = range(view.view_start, len(stream))
    tokens = [stream[p - view.view_start] if p < view.window_start else stream[p] for p in positions]
    got = np.stack([keys[:, p] for p in positions])
    want = np.stack([key_at(model, t, p) for t, p in zip(tokens, positions)])
    scale = np.abs(want).max()
    error = np.abs(got.astype(np.float64) - want)
    if kv_dtype is None:
        assert error.max() <= tol * scale
    elif kv_dtype == "float16":
        assert error.max() <= 2 * 2.0 ** -11 * scale  # two float16 roundings at most
    else:  # a step is set by the key's range, at most twice the largest norm of a channel pair (which the
        # rotation keeps); half a step per rounding, mixed over a pair: step / sqrt 2, twice at most
        half = want.shape[-1] // 2
        pair_norm = np.hypot(want[..., :half], want[..., half:]).max(axis=-1, keepdims=True)
        step = 2 * pair_norm / (255 if kv_dtype == "int8" else 15)
        rounding = step / np.sqrt(2) * 1.01
        assert np.all(error[:view.prefix] <= 2 * rounding[:view.prefix])  # measured: up to 0.95 roundings
        assert np.all(error[view.prefix:] <= rounding[view.prefix:])      # the tail, as stored: one
    engine.abort_request("r")
    engine.step()
    assert pool.num_used_blocks == 0


# --- what the model sees ---------------------------------------------------------------------------------
def reference_logits(model, stream, sinks, window):
    """StreamingLLM by hand: every row computed so far is recorded with the position it was computed at;
    each step builds a fresh cache from the first `sinks` and last `window - 1` rows, each key rotated by
    kvlab.apply_rope to its place in that cache, and runs the token on it."""
    rows, out = [], []  # rows[t] = (position, [(key, value) per layer]) of token t
    for t, token in enumerate(stream):
        chosen = list(range(t)) if t < sinks + window else \
            list(range(sinks)) + list(range(t - window + 1, t))
        keys, values = [], []
        for layer in range(model.config.num_hidden_layers):
            ks = [apply_rope(rows[r][1][layer][0], [i - rows[r][0]], inv_freq=model.inv_freq)
                  for i, r in enumerate(chosen)]
            keys.append(np.concatenate(ks, axis=2) if ks else np.zeros((1, 2, 0, 8)))
            values.append(np.concatenate([rows[r][1][layer][1] for r in chosen], axis=2) if chosen
                          else np.zeros((1, 2, 0, 8)))
        cache = KVCache.from_arrays(model.cache_spec, keys, values, np.arange(len(chosen)))
        out.append(model.forward([[token]], cache=cache).logits[0, -1])
        rows.append((len(chosen), [(k[:, :, -1:], v[:, :, -1:]) for k, v in cache]))
    return np.stack(out)


def engine_logits(model, stream, policy=None, kv_dtype=None) -> np.ndarray:
    """The engine's logits after every token of `stream`, fed one token a step (Engine.score)."""
    engine = Engine(model, block_size=4, num_blocks=2 * (-(-len(stream) // 4)) + 4, max_num_batched_tokens=1,
                    kv_policy=policy, kv_cache_dtype=kv_dtype, enable_prefix_caching=False)
    logits = np.stack(engine.score([int(t) for t in stream]).logits)
    assert engine.block_pool.num_used_blocks == 0
    return logits


@pytest.mark.parametrize("sinks,window", [(4, 6), (0, 8), (1, 3)])
def test_sinks_and_window_equal_a_hand_built_reference_cache(sinks, window):
    """Three ways to the same logits: StreamingLLM by hand here, the verifier's PolicyCache and the engine."""
    model = model64()
    stream = np.random.default_rng(2).integers(0, 256, 40)
    policy = AttentionSinks(sinks, window) if sinks else SlidingWindow(window)
    want = reference_logits(model, stream, sinks, window)
    reference = PolicyCache(model, policy)
    by_hand = np.stack([reference.feed([t])[-1] for t in stream])
    assert np.abs(by_hand - want).max() < 1e-10
    assert reference.length == policy.budget
    assert np.abs(engine_logits(model, stream, policy) - want).max() < 1e-10


def test_a_window_as_long_as_the_text_changes_nothing():
    model = model64()
    stream = np.random.default_rng(3).integers(0, 256, (1, 30))
    plain = model.new_cache()
    exact = np.concatenate([model.forward(stream[:, i:i + 1], cache=plain).logits for i in range(30)], 1)[0]
    assert np.array_equal(engine_logits(model, stream[0]), exact)
    for policy in [SlidingWindow(30), AttentionSinks(4, 26), ContextShift(4, 30)]:
        assert np.array_equal(engine_logits(model, stream[0], policy), exact)
        assert np.array_equal(PolicyCache(model, policy).feed(stream[0], chunk=1), exact)


def test_generation_with_a_context_shift_runs_past_the_context():
    model = model64()
    prompt = [5, 6, 7]
    plain = generate(model, [prompt], 61)[0].tolist()  # up to the end of the 64-token context
    engine = Engine(model, kv_policy=ContextShift(1, 64), block_size=4)
    [out] = engine.generate([prompt], SamplingParams(max_tokens=200, ignore_eos=True))
    shifted = out.outputs[0].token_ids
    assert len(shifted) == 200 and out.outputs[0].finish_reason == "length"
    assert shifted[:61] == plain  # identical until the first shift
    assert shifted == greedy_tokens(model, ContextShift(1, 64), prompt, 200)
    with pytest.raises(InputError, match="exceed max_model_len 64"):
        Engine(model).generate([prompt], SamplingParams(max_tokens=200))
    with pytest.raises(ConfigError, match="holds 100 tokens but max_model_len is 64"):
        Engine(model, kv_policy=SlidingWindow(100))


def test_quantized_cache_under_a_policy_stays_close_to_the_float_one():
    model = model64(np.float32)
    stream = np.random.default_rng(4).integers(0, 256, 90)
    runs = {kv_dtype: engine_logits(model, stream, AttentionSinks(2, 14), kv_dtype) for kv_dtype in [None, "int8"]}
    assert 0 < np.abs(runs["int8"] - runs[None]).max() < 0.1


# --- names -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text,message", [
    ("window", "needs 1 number"), ("window:0", ">= 1"), ("window:x", "integer"), ("sinks:4", "needs 2"),
    ("lru:4", "unknown cache policy"), ("shift:30:300", "context is 64"), ("h2o:1:2", "H2O .heavy hitters. was removed"),
    ("shift:40:41", "nothing would be left"), ("window:65", "context is 64"), ("sinks:-1:4", ">= 0"),
])
def test_bad_policy_strings_are_refused_clearly(text, message):
    with pytest.raises(InputError, match=message):
        parse_policy(text, 64)


def test_cache_choices_combine_a_dtype_and_a_policy():
    choice = parse_cache_choice("int8+sinks:4:60", 64)
    assert choice.kv_dtype == "int8" and isinstance(choice.policy, AttentionSinks)
    assert parse_cache_choice("exact", 64).policy is None and parse_cache_choice("exact", 64).kv_dtype is None
    assert parse_policy("shift:4", 64).budget == 64
    for bad, message in [("int9", "unsupported KV cache dtype"), ("int8+int4", "two cache dtypes"),
                         ("window:4+sinks:1:3", "two policies"), ("int8+", "empty part")]:
        with pytest.raises(InputError, match=message):
            parse_cache_choice(bad, 64)


# --- the CLI ---------------------------------------------------------------------------------------------
def kvlab_generate(*args):
    import subprocess
    import sys
    return subprocess.run([sys.executable, "-m", "kvlab", "generate", *args], capture_output=True, text=True,
                          timeout=600)


def test_generate_cli_keeps_writing_past_the_context_with_a_context_shift():
    out = kvlab_generate("ROMEO:", "-n", "300", "--temperature", "0", "--ignore-eos", "--context-shift",
                         "--keep", "2")
    assert out.returncode == 0, out.stderr
    assert "decode 300 tokens" in out.stderr and "stop: max tokens" in out.stderr
    plain = kvlab_generate("ROMEO:", "-n", "300", "--temperature", "0", "--ignore-eos")
    assert "stop: context full" in plain.stderr  # without the flag the 256-token context ends it
    assert out.stdout.startswith(plain.stdout.rstrip("\n")[:200])  # identical until the first shift


@pytest.mark.parametrize("args,message", [
    (["--context-shift", "--keep", "-5"], "--keep must be >= 0"),
    (["--cache-policy", "window:0"], "window size W must be >= 1"),
    (["--cache-policy", "window:300"], "context is 256"),
    (["--context-shift", "--cache-policy", "window:8"], "not both"),
    (["--cache-policy", "sinks:4:60", "--prompt-cache", "x.kvlab"], "cannot be combined"),
])
def test_generate_cli_refuses_bad_policy_flags(args, message, tmp_path):
    out = kvlab_generate("ROMEO:", "-n", "4", *[str(tmp_path / a) if a.endswith(".kvlab") else a for a in args])
    assert out.returncode == 2 and message in out.stderr, out.stderr
    assert not list(tmp_path.iterdir())
