"""The building blocks against independent references: RoPE by hand and by its algebra, attention per head."""


import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from references import attention_reference

from kvlab import apply_rope, grouped_attention
from kvlab.model.layers import attention_mask, rope_inv_freq


def test_rope_preserves_norms_and_is_identity_at_zero():
    x = np.random.default_rng(0).standard_normal((2, 3, 5, 8))
    rotated = apply_rope(x, np.arange(5))
    np.testing.assert_allclose(np.linalg.norm(rotated, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-12)
    np.testing.assert_allclose(rotated[:, :, 0], x[:, :, 0], atol=0)


@given(m=st.integers(0, 500), n=st.integers(0, 500), shift=st.integers(0, 500))
def test_rope_scores_depend_only_on_relative_position(m, n, shift):
    rng = np.random.default_rng(1)
    q, k = rng.standard_normal((1, 1, 1, 8)), rng.standard_normal((1, 1, 1, 8))
    s1 = np.sum(apply_rope(q, [m]) * apply_rope(k, [n]))
    s2 = np.sum(apply_rope(q, [m + shift]) * apply_rope(k, [n + shift]))
    assert abs(s1 - s2) < 1e-9


def test_rope_matches_complex_rotation_of_half_pairs():
    # rotate-half convention: channel i pairs with i + d/2 and turns by pos * theta^(-2i/d)
    d, pos = 8, 7
    x = np.random.default_rng(2).standard_normal(d)
    z = (x[: d // 2] + 1j * x[d // 2:]) * np.exp(1j * pos * rope_inv_freq(d))
    want = np.concatenate([z.real, z.imag])
    np.testing.assert_allclose(apply_rope(x[None, None, None], [pos])[0, 0, 0], want, atol=1e-12)


def test_rope_per_row_positions_equal_separate_calls():
    x = np.random.default_rng(3).standard_normal((2, 2, 3, 8))
    positions = np.array([[0, 1, 2], [5, 6, 7]])
    both = apply_rope(x, positions)
    for row in range(2):
        np.testing.assert_allclose(both[row], apply_rope(x[row:row + 1], positions[row])[0], atol=1e-13)


def test_mask_uses_absolute_positions_as_in_the_seed():
    past_length, new_length = 6, 2
    query_positions = np.arange(past_length, past_length + new_length)
    key_positions = np.arange(past_length + new_length)
    allowed = attention_mask(query_positions, key_positions)
    assert allowed.shape == (2, 8)
    assert allowed[0].tolist() == [True] * 7 + [False]
    assert allowed[1].all()
    window = attention_mask(query_positions, key_positions, sliding_window=3)
    assert np.flatnonzero(window[0]).tolist() == [4, 5, 6]
    assert attention_mask(np.array([6]), np.arange(7)) is None  # decode step: nothing to mask


@given(batch=st.integers(1, 2), kv_heads=st.integers(1, 3), group=st.integers(1, 4),
       past=st.integers(0, 40), new=st.integers(1, 24), window=st.one_of(st.none(), st.integers(1, 30)),
       causal=st.booleans(), d=st.sampled_from([2, 4, 6, 8, 16, 64]), seed=st.integers(0, 2**16))
def test_grouped_attention_matches_per_head_reference(batch, kv_heads, group, past, new, window, causal, d,
                                                      seed):
    # new * group crosses SMALL_QUERY_ROWS (16), so both score orientations of `_attend_block` are drawn
    rng = np.random.default_rng(seed)
    heads = kv_heads * group
    q = rng.standard_normal((batch, heads, new, d))
    k, v = rng.standard_normal((2, batch, kv_heads, past + new, d))
    qpos, kpos = np.arange(past, past + new), np.arange(past + new)
    got = grouped_attention(q, k, v, query_positions=qpos, key_positions=kpos, sliding_window=window,
                            causal=causal)
    want = attention_reference(q, k, v, qpos, kpos, window, causal)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)


def test_fully_masked_row_gives_zeros_not_nan():
    q = np.ones((1, 1, 1, 4))
    k = v = np.ones((1, 1, 2, 4))
    out = grouped_attention(q, k, v, query_positions=np.array([0]), key_positions=np.array([5, 6]))
    assert np.all(out == 0)


def test_grouping_rejects_incompatible_heads():
    with pytest.raises(ValueError, match="cannot be grouped"):
        grouped_attention(np.ones((1, 3, 1, 4)), np.ones((1, 2, 1, 4)), np.ones((1, 2, 1, 4)),
                          query_positions=[0], key_positions=[0])


def test_softmax_matches_the_textbook_formula_with_and_without_a_mask():
    from kvlab.model.layers import softmax, softmax_
    scores = np.array([[1.0, 2.0, 3.0, -1.0], [0.5, 0.5, -2.0, 4.0], [3.0, 1.0, 0.0, 2.0]])
    e = np.exp(scores - scores.max(axis=-1, keepdims=True))
    np.testing.assert_allclose(softmax(scores), e / e.sum(axis=-1, keepdims=True), rtol=0, atol=1e-15)
    mask = np.array([[True, True, False, False], [False, False, False, False], [False, True, True, True]])
    got = softmax(scores, mask)
    np.testing.assert_allclose(got[0], np.exp([1.0, 2.0]) / np.exp([1.0, 2.0]).sum() @ np.eye(2, 4),
                               rtol=0, atol=1e-15)
    assert got[1].tolist() == [0.0, 0.0, 0.0, 0.0]  # a row that sees no key: zeros, not NaN
    np.testing.assert_allclose(got[2], np.r_[0.0, np.exp([1.0, 0.0, 2.0]) / np.exp([1.0, 0.0, 2.0]).sum()],
                               rtol=0, atol=1e-15)
    assert scores[0, 0] == 1.0  # softmax copies; softmax_ works in place and returns its argument
    work = scores.copy()
    assert softmax_(work, mask) is work and np.array_equal(work, got)
    huge = softmax(np.array([[1000.0, 999.0], [-1000.0, -1001.0]], dtype=np.float32))
    assert huge.dtype == np.float32
    np.testing.assert_allclose(huge, [[1 / (1 + np.exp(-1)), 1 / (1 + np.exp(1))]] * 2, rtol=1e-6)
    assert softmax(np.array([[1, 2]])).dtype == np.float64  # integer scores are promoted, not truncated
    # attention's layout: [heads, queries, keys], normalized over the last axis only
    scores3 = np.random.default_rng(0).standard_normal((2, 3, 5))
    mask3 = np.tril(np.ones((3, 5), dtype=bool), k=2)
    got3 = softmax(scores3, mask3)
    want3 = np.where(mask3, np.exp(scores3), 0.0)
    np.testing.assert_allclose(got3, want3 / want3.sum(axis=-1, keepdims=True), rtol=0, atol=1e-15)
    e3 = np.exp(scores3)
    np.testing.assert_allclose(softmax(scores3), e3 / e3.sum(axis=-1, keepdims=True), rtol=0, atol=1e-15)


def test_silu_and_swiglu_match_x_sigmoid_x():
    from kvlab.model.layers import silu, swiglu
    x = np.array([-1000.0, -30.0, -1.0, 0.0, 0.5, 3.0, 40.0])
    want = x / (1.0 + np.exp(-np.clip(x, -700, None)))
    want[0] = -0.0
    np.testing.assert_allclose(silu(x), want, rtol=1e-15, atol=0)
    up = np.linspace(-2, 2, x.size)
    with np.errstate(over="ignore"):
        np.testing.assert_allclose(swiglu(x.copy(), up), want * up, rtol=1e-15, atol=0)
    with np.errstate(over="raise"):
        assert silu(np.array([-1000.0]))[0] == 0.0  # silu guards its own overflow


def test_rope_scaling_rules():
    base = rope_inv_freq(16, 10000.0)
    np.testing.assert_allclose(rope_inv_freq(16, 10000.0, {"rope_type": "linear", "factor": 4.0}), base / 4,
                               rtol=1e-15)
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 64}
    got = rope_inv_freq(16, 10000.0, llama3)
    wavelen = 2 * np.pi / base
    for i, (f, w) in enumerate(zip(base, wavelen)):  # the three bands of Llama 3.1's rule, one at a time
        if w < 64 / 4.0:
            want = f                                   # high frequencies: unchanged
        elif w > 64 / 1.0:
            want = f / 8.0                             # low frequencies: divided by the factor
        else:
            smooth = (64 / w - 1.0) / (4.0 - 1.0)
            want = (1 - smooth) * f / 8.0 + smooth * f  # in between: interpolated
        assert abs(got[i] - want) <= 1e-15 * max(1.0, want), i
    assert (wavelen < 16).any() and (wavelen > 64).any() and ((wavelen >= 16) & (wavelen <= 64)).any()
    # low_freq_factor 2 (not 1) so that old_len / low and old_len * low differ; float32 stays float32
    wide = {**llama3, "low_freq_factor": 2.0, "original_max_position_embeddings": 128}
    got32 = rope_inv_freq(16, 10000.0, wide, np.float32)
    assert got32.dtype == np.float32
    for f, w, g in zip(base, wavelen, got32):
        smooth = (128 / w - 2.0) / (4.0 - 2.0)
        want = f if w < 128 / 4.0 else f / 8.0 if w > 128 / 2.0 else (1 - smooth) * f / 8.0 + smooth * f
        assert abs(g - want) <= 1e-6 * want
    assert ((wavelen > 64) & (wavelen <= 256)).any()  # a wavelength that the two readings classify apart
    with pytest.raises(ValueError, match="unsupported rope type 'yarn'"):
        rope_inv_freq(16, 10000.0, {"rope_type": "yarn"})
    assert rope_inv_freq(8, 500.0, None, np.float32).dtype == np.float32


def rope_by_hand(x, positions, theta, dtype):
    """transformers' float32/float64 RoPE: inv_freq and angles computed in `dtype`, rotate_half convention."""
    d = x.shape[-1]
    inv_freq = (1.0 / (dtype(theta) ** (np.arange(0, d, 2).astype(dtype) / dtype(d)))).astype(dtype)
    angles = np.asarray(positions).astype(dtype)[:, None] * inv_freq
    cos, sin = np.cos(np.concatenate([angles, angles], -1)), np.sin(np.concatenate([angles, angles], -1))
    rotated_half = np.concatenate([-x[..., d // 2:], x[..., : d // 2]], axis=-1)
    return x * cos + rotated_half * sin


@pytest.mark.parametrize("theta", [10000.0, 500.0])
def test_rope_float32_rounds_as_transformers_does(theta):
    # at position ~5000 an angle rounded in float64 instead of float32 moves outputs by ~1e-4
    x = np.random.default_rng(4).standard_normal((1, 2, 4, 16)).astype(np.float32)
    positions = np.array([0, 7, 4999, 5003])
    got = apply_rope(x, positions, theta=theta)
    assert got.dtype == np.float32
    # bit-identical: the same float32 operations in the same order (cos/sin from the same NumPy build)
    np.testing.assert_array_equal(got, rope_by_hand(x, positions, theta, np.float32))
    in64 = apply_rope(x.astype(np.float64), positions, theta=theta)
    np.testing.assert_allclose(in64, rope_by_hand(x.astype(np.float64), positions, theta, np.float64),
                               rtol=0, atol=1e-12)
    assert np.abs(in64 - got).max() > 1e-5  # the two precisions really differ here (measured 3.8e-5)


def test_rope_float16_input_is_rotated_in_float64():
    x = np.random.default_rng(5).standard_normal((1, 1, 3, 8)).astype(np.float16)
    positions = np.array([3, 777, 2999])  # angles float16 cannot hold (rotating in float16 is off by ~0.5)
    got = apply_rope(x, positions)
    assert got.dtype == np.float16
    want = rope_by_hand(x.astype(np.float64), positions, 10000.0, np.float64)
    # measured max error 1.2e-3 (float16 output rounding of values up to ~2); bound 4e-3.
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=0, atol=4e-3)


def test_grouped_attention_honours_an_explicit_scale():
    rng = np.random.default_rng(6)
    q = rng.standard_normal((1, 4, 3, 8))
    k, v = rng.standard_normal((2, 1, 2, 5, 8))
    qpos, kpos = np.arange(2, 5), np.arange(5)
    got = grouped_attention(q, k, v, query_positions=qpos, key_positions=kpos, scale=0.05)
    # the default scale is 1/sqrt(8); scale 0.05 is the default applied to q * 0.05 * sqrt(8)
    want = attention_reference(q * 0.05 * np.sqrt(8), k, v, qpos, kpos)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
    assert np.abs(got - grouped_attention(q, k, v, query_positions=qpos, key_positions=kpos)).max() > 1e-3
