"""Cache policies: the rows they keep, the positions they move them to, and what the model sees then."""

import numpy as np
import pytest
from hypothesis import given, strategies as st

from kvlab import InputError, TinyLlama, apply_rope, generate
from kvlab.cache.kv_cache import KVCache
from kvlab.policies import (AttentionSinks, ContextShift, HeavyHitters, SlidingWindow, forward_with_policy,
                            make_room, parse_cache_choice, parse_policy, rerotate_keys)


def model64(dtype=np.float64, **changes):
    return TinyLlama(seed=11, dtype=dtype, max_position_embeddings=64, **changes)


# --- which rows ------------------------------------------------------------------------------------------
@given(st.integers(1, 40), st.integers(0, 6), st.integers(1, 12), st.data())
def test_every_policy_keeps_ascending_rows_within_its_budget(length, sinks, window, data):
    policies = [SlidingWindow(window), AttentionSinks(sinks, window), HeavyHitters(sinks, window)]
    if sinks < window - 1:
        policies.append(ContextShift(sinks, window))
    for policy in policies:
        policy.scores = np.random.default_rng(length).random(length)  # H2O's accumulated attention
        num_new = data.draw(st.integers(1, policy.max_chunk))
        if length + num_new <= policy.budget:
            continue
        rows = policy.keep(length, num_new)
        assert rows.size + num_new <= policy.budget
        assert np.all(np.diff(rows) > 0) and (rows.size == 0 or 0 <= rows[0] and rows[-1] < length)
        protected = getattr(policy, "sinks", getattr(policy, "heavy", getattr(policy, "n_keep", 0)))
        if rows.size > protected:  # any recent row kept: the newest is one of them
            assert rows[-1] == length - 1


def test_sinks_window_shift_and_heavy_hitters_choose_the_documented_rows():
    assert AttentionSinks(2, 4).keep(10, 1).tolist() == [0, 1, 7, 8, 9]
    assert SlidingWindow(4).keep(10, 2).tolist() == [8, 9]
    # llama.cpp: n_keep=2 of 10, discard (10 - 2) // 2 = 4 rows after the kept ones
    assert ContextShift(2, 10).keep(10, 1).tolist() == [0, 1, 6, 7, 8, 9]
    h2o = HeavyHitters(2, 3)
    h2o.scores = np.array([5.0, 0.1, 3.0, 0.2, 9.0, 0.0, 0.0])
    assert h2o.keep(7, 1).tolist() == [0, 4, 5, 6]
    assert h2o.scores.tolist() == [5.0, 9.0, 0.0, 0.0]  # scores follow their rows


# --- positions: re-rotation ------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,tol", [(np.float32, 1e-5), (np.float64, 1e-12)])
def test_rerotated_keys_equal_keys_computed_at_the_new_positions(dtype, tol):
    rng = np.random.default_rng(0)
    model = model64(dtype)
    raw = rng.standard_normal((1, 2, 30, 8)).astype(dtype)
    old = rng.integers(0, 64, 30)
    new = rng.integers(0, 64, 30)
    stored = apply_rope(raw, old, inv_freq=model.inv_freq)
    moved = rerotate_keys(stored, new - old, model.inv_freq)
    fresh = apply_rope(raw, new, inv_freq=model.inv_freq)
    assert moved.dtype == dtype
    assert np.abs(moved - fresh).max() <= tol * np.abs(fresh).max()


@pytest.mark.parametrize("dtype,tol", [(np.float32, 1e-5), (np.float64, 1e-12)])
@pytest.mark.parametrize("kv_dtype", [None, "float16", "int8", "int4"])
@pytest.mark.parametrize("make_policy", [lambda: ContextShift(3, 20), lambda: AttentionSinks(2, 14)])
def test_repeated_shifts_leave_keys_as_if_computed_at_their_new_positions(dtype, tol, kv_dtype, make_policy):
    """llama.cpp #5652 / #4097: after many shifts every kept key must still be a pure rotation. A sinks
    policy moves every window row at every step, so each key lives through ~13 moves."""
    model = model64(dtype)
    stream = np.random.default_rng(1).integers(0, 256, 150)
    policy = make_policy()
    cache = model.new_cache(kv_dtype=kv_dtype)
    policy.start(cache)
    held, shifts = [], 0
    for token in stream:
        if len(held) + 1 > policy.budget:
            held = [held[r] for r in policy.keep(len(held), 1)]
            shifts += 1
        forward_with_policy(model, [[token]], cache, policy)
        held.append(int(token))
    assert shifts >= 10 and cache.positions.tolist() == list(range(len(held)))
    # Layer 0's keys and values depend only on the token and its position: recompute them from scratch,
    # one token per forward as they were first computed (a prefill's matmul rounds differently).
    fresh = model.new_cache(kv_dtype=kv_dtype)
    for token in held:
        model.forward([[token]], cache=fresh)
    keys, values = cache[0]
    want_keys, want_values = fresh[0]
    assert np.array_equal(values, want_values)  # values carry no position: never touched
    scale = np.abs(want_keys).max()
    error = np.abs(keys.astype(np.float64) - want_keys).max()
    if kv_dtype is None:
        assert error <= tol * scale
    elif kv_dtype == "float16":  # float16 storage rounds each rotated key once more per shift it lives
        assert error <= 1e-2 * scale
    else:  # codes are kept and rotated on read: one rounding, however many times the key moved. The step
        # was set by the key at its old position, whose range is at most twice the largest norm of a
        # rotated channel pair (norms the rotation keeps); half a step, mixed over a pair: step / sqrt 2.
        exact = model.new_cache()
        for token in held:
            model.forward([[token]], cache=exact)
        half = exact[0][0].shape[-1] // 2
        pair_norm = np.hypot(exact[0][0][..., :half], exact[0][0][..., half:]).max(axis=-1, keepdims=True)
        step = 2 * pair_norm / (255 if kv_dtype == "int8" else 15)
        assert np.all(np.abs(keys - exact[0][0]) <= step / np.sqrt(2) * 1.01)


def test_retain_validates_before_it_changes_anything():
    model = model64()
    cache = model.new_cache()
    model.forward(np.arange(1, 11)[None], cache=cache)
    before = [k.copy() for k, _ in cache]
    for rows, positions in [([3, 2], None), ([0, 10], None), ([-1, 2], None), ([[1]], None),
                            ([1, 2], [0, 1]), ([1, 2], [0]), ([1, 2], [-1, 0])]:
        with pytest.raises(InputError):
            cache.retain(rows, positions)  # the last three move keys without a rotation, or badly
    assert cache.get_seq_length() == 10
    assert all(np.array_equal(k, b) for (k, _), b in zip(cache, before))
    with pytest.raises(InputError, match="1..4 new tokens"):
        make_room(model, cache, SlidingWindow(4), 5)
    assert cache.get_seq_length() == 10


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


@pytest.mark.parametrize("sinks,window", [(4, 6), (0, 8), (1, 3)])
def test_sinks_and_window_equal_a_hand_built_reference_cache(sinks, window):
    model = model64()
    stream = np.random.default_rng(2).integers(0, 256, 40)
    policy = AttentionSinks(sinks, window) if sinks else SlidingWindow(window)
    cache = model.new_cache()
    policy.start(cache)
    got = np.stack([forward_with_policy(model, [[t]], cache, policy)[0, -1] for t in stream])
    want = reference_logits(model, stream, sinks, window)
    assert np.abs(got - want).max() < 1e-10
    assert cache.get_seq_length() == policy.budget


def test_a_window_as_long_as_the_text_changes_nothing():
    model = model64()
    stream = np.random.default_rng(3).integers(0, 256, (1, 30))
    plain = model.new_cache()
    exact = np.concatenate([model.forward(stream[:, i:i + 1], cache=plain).logits for i in range(30)], 1)
    for policy in [SlidingWindow(30), AttentionSinks(4, 26), ContextShift(4, 30), HeavyHitters(10, 20)]:
        cache = model.new_cache()
        policy.start(cache)
        got = np.concatenate([forward_with_policy(model, stream[:, i:i + 1], cache, policy)
                              for i in range(30)], axis=1)
        if isinstance(policy, HeavyHitters):  # observed attention gathers and runs the NumPy reference
            assert np.abs(got - exact).max() < 1e-12
        else:
            assert np.array_equal(got, exact)


def test_heavy_hitter_scores_are_attention_probabilities():
    model = model64()
    policy = HeavyHitters(4, 4)
    cache = model.new_cache()
    policy.start(cache)
    forward_with_policy(model, np.arange(1, 5)[None], cache, policy)
    c = model.config
    # every query row of every head in every layer spreads probability 1 over the keys it sees
    assert policy.scores.sum() == pytest.approx(c.num_hidden_layers * c.num_attention_heads * 4)
    assert policy.scores[0] > policy.scores[3]  # causal: the first key is seen by every query
    for token in range(5, 30):
        forward_with_policy(model, [[token]], cache, policy)
    assert cache.get_seq_length() == 8 and policy.scores.shape == (8,)
    # still observed after the evictions (through the forward's attention: the cache holds no observer);
    # a step without eviction adds probability 1 per layer and query head
    assert not hasattr(cache, "observer")
    mass = policy.scores.sum()
    model.forward([[30]], cache=cache, observer=policy.observe)
    assert policy.scores.sum() == pytest.approx(mass + c.num_hidden_layers * c.num_attention_heads)


def test_generation_with_a_context_shift_runs_past_the_context():
    model = model64()
    prompt = np.array([[5, 6, 7]])
    plain = generate(model, prompt, 61)  # up to the end of the 64-token context
    shifted = generate(model, prompt, 200, policy=ContextShift(1, 64))
    assert shifted.shape == (1, 200)
    assert np.array_equal(shifted[:, :61], plain)  # identical until the first shift
    with pytest.raises(InputError, match="max_new_tokens"):
        generate(model, prompt, None, policy=ContextShift(1, 64))
    with pytest.raises(InputError, match="context is 64"):
        generate(model, prompt, 10, policy=SlidingWindow(100))


def test_quantized_cache_under_a_policy_stays_close_to_the_float_one():
    model = model64(np.float32)
    stream = np.random.default_rng(4).integers(0, 256, (1, 90))
    runs = {}
    for kv_dtype in [None, "int8"]:
        cache = model.new_cache(kv_dtype=kv_dtype)
        policy = AttentionSinks(2, 14)
        runs[kv_dtype] = np.concatenate([forward_with_policy(model, stream[:, i:i + 1], cache, policy)
                                         for i in range(90)], axis=1)
    assert 0 < np.abs(runs["int8"] - runs[None]).max() < 0.1


# --- names -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text,message", [
    ("window", "needs 1 number"), ("window:0", ">= 1"), ("window:x", "integer"), ("sinks:4", "needs 2"),
    ("lru:4", "unknown cache policy"), ("shift:30:300", "context is 64"), ("h2o:1:2:3", "needs 2"),
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
