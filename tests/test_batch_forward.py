"""The batched paged forward equals a full recompute for every sequence, whatever the batch and chunks."""

import numpy as np
from hypothesis import given, settings, strategies as st

from kvlab import TinyLlama
from kvlab.cache.paged import gather_blocks, write_slots
from kvlab.verify.schedules import paged_logits
from kvlab.model.layers import grouped_attention
from kvlab.model.paged_attention import paged_attention


def chunking(length, draw_sizes):
    sizes, left = [], length
    for size in draw_sizes:
        if left == 0:
            break
        sizes.append(min(size, left))
        left -= sizes[-1]
    if left:
        sizes.append(left)
    return sizes


@settings(max_examples=25)
@given(st.data())
def test_batched_chunked_forward_equals_full_recompute(data):
    kv_heads = data.draw(st.sampled_from([1, 2, 4]))
    window = data.draw(st.sampled_from([None, None, 5]))
    model = TinyLlama(seed=data.draw(st.integers(0, 3)), num_key_value_heads=kv_heads, sliding_window=window)
    block_size = data.draw(st.sampled_from([1, 2, 4, 16]))
    num_seqs = data.draw(st.integers(1, 4))
    prompts = [data.draw(st.lists(st.integers(0, 259), min_size=1, max_size=40)) for _ in range(num_seqs)]
    chunks = [chunking(len(p), data.draw(st.lists(st.integers(1, 12), min_size=1, max_size=40)))
              for p in prompts]
    logits = paged_logits(model, prompts, chunks, block_size)
    for prompt, got in zip(prompts, logits):
        want = model.forward(np.array([prompt])).logits[0]
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-10)


def test_float32_and_low_precision_pool_stay_close():
    model = TinyLlama(seed=1, dtype=np.float32)
    prompts = [list(range(3, 40)), list(range(50, 61))]
    logits = paged_logits(model, prompts, [[10, 1, 1, 25], [3, 8]], block_size=4)
    for prompt, got in zip(prompts, logits):
        want = model.forward(np.array([prompt])).logits[0]
        assert np.abs(got - want).max() < 1e-4
    half = paged_logits(model, prompts, [[37], [11]], block_size=4, kv_dtype=np.float16)
    assert np.abs(half[0] - logits[0]).max() < 0.05  # fp16 storage: a measured, bounded error


def test_paged_attention_equals_grouped_attention_on_gathered_keys():
    rng = np.random.default_rng(0)
    cache_k, cache_v = rng.standard_normal((2, 6, 2, 4, 8))
    table = np.array([[4, 1, 3]])
    q = rng.standard_normal((1, 4, 3, 8))
    positions = np.array([[7, 8, 9]])
    got = paged_attention(q, cache_k, cache_v, table, positions, [10])
    keys, values = gather_blocks(cache_k, table, 10), gather_blocks(cache_v, table, 10)
    np.testing.assert_array_equal(keys[0, :, 5], cache_k[1, :, 1])
    want = grouped_attention(q, keys, values, query_positions=positions[0], key_positions=np.arange(10))
    np.testing.assert_allclose(got, want, atol=1e-12)
    # a padded batch of two decodes: each row sees only its own context
    tables = np.array([[4, 1, 3], [2, 0, 0]])
    out = paged_attention(q[:, :, :1].repeat(2, 0), cache_k, cache_v, tables, np.array([[9], [2]]), [10, 3])
    single = paged_attention(q[:, :, :1], cache_k, cache_v, tables[1:, :1], np.array([[2]]), [3])
    np.testing.assert_allclose(out[1], single[0], atol=1e-12)
    padding_row = paged_attention(q, cache_k, cache_v, table, np.array([[7, 8, -1]]), [10])
    assert not padding_row[0, :, 2].any()


def test_write_slots_places_rows_by_block_and_offset():
    k = np.zeros((5, 2, 4, 3))
    v = np.zeros_like(k)
    new = np.arange(2 * 2 * 3, dtype=float).reshape(2, 2, 3) + 1
    write_slots(k, v, np.array([13, 2]), new, -new)
    np.testing.assert_array_equal(k[3, :, 1], new[0])
    np.testing.assert_array_equal(v[0, :, 2], -new[1])
    assert np.count_nonzero(k) == 12


@settings(max_examples=15)
@given(st.data())
def test_compiled_paged_decode_equals_the_numpy_gather(data):
    """The engine's decodes read the pool in place with the compiled kernel; the NumPy path gathers the
    blocks and runs `attend`. Same logits (float64: to rounding), windows and half-precision pools too."""
    window = data.draw(st.sampled_from([None, 3, 7]))
    kv_heads = data.draw(st.sampled_from([1, 2, 4]))
    kv_dtype = data.draw(st.sampled_from([None, np.float16, "bfloat16"]))
    seed = data.draw(st.integers(0, 3))
    models = [TinyLlama(seed=seed, num_key_value_heads=kv_heads, sliding_window=window, backend=backend)
              for backend in ("numba", "numpy")]
    prompts = [data.draw(st.lists(st.integers(0, 259), min_size=2, max_size=30)) for _ in range(3)]
    # a prefill chunk, then one token per step: every later step is a batch of decodes
    chunks = [[n := data.draw(st.integers(1, len(p) - 1))] + [1] * (len(p) - n) for p in prompts]
    block_size = data.draw(st.sampled_from([1, 4, 16]))
    compiled, reference = (paged_logits(m, prompts, chunks, block_size, kv_dtype=kv_dtype) for m in models)
    assert models[0].backend == "numba" and models[1].backend == "numpy"
    for got, want in zip(compiled, reference):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-10)
