"""Batch-invariant attention (ARCHITECTURE.md invariant 13) and what it buys: `kvlab verify` holds the
lossy int8-activation mode to equality.

The decode kernel (kvlab/kernels/attention.py) gives a query row the same bits whatever the block size of
the cache it reads (paged blocks of any size, or a contiguous cache), whatever rows run beside it and
however many threads run: each score is its own dot product, the softmax sees a whole span, values are
added key by key, spans are cut from the row's first key. With `activations="q8"` a row's products do not
depend on the rows beside it either, so the model runs prefill attention through that kernel too; then a
cached, chunked, batched or paged forward gives every row the logits a full recompute gives, bit for bit,
and a rounding boundary can no longer split two paths apart.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab.kernels import AVAILABLE

needs_numba = pytest.mark.skipif(not AVAILABLE, reason="numba is not installed")


def paged_copy(contiguous: np.ndarray, block_size: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """[1, H, T, d] rows as blocks [num_blocks, H, block_size, d] in a shuffled order, and the block table."""
    _, heads, length, d = contiguous.shape
    count = -(-length // block_size)
    order = rng.permutation(count + 2)[:count]  # two spare blocks so the table is not the identity
    blocks = rng.standard_normal((count + 2, heads, block_size, d)).astype(contiguous.dtype)
    for i, block in enumerate(order):
        rows = contiguous[0, :, i * block_size:(i + 1) * block_size]
        blocks[block, :, :rows.shape[1]] = rows
    return blocks, order[None].astype(np.int64)


@needs_numba
@settings(max_examples=30, deadline=None)
@given(type_name=st.sampled_from(["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q4_K", "Q6_K"]), out=st.integers(1, 44),
       n_blocks=st.integers(1, 2), wide=st.booleans(), rows=st.integers(2, 40), seed=st.integers(0, 2**16))
def test_an_integer_products_row_ignores_the_rows_beside_it(type_name, out, n_blocks, wide, rows, seed):
    """The int8-activation product (kernels/qdot.py) runs rows of x eight, four, two or one at a time, so
    a row lands in a different block of the kernel as the batch around it changes: its output must be the
    same bits in every case, alone, and at any offset in a larger batch, for narrow and wide (4,608
    columns) matrices; and near the float64 product."""
    from kvlab.model.act_quant import rounded

    from gguf_files import blocks
    from kvlab.model.ggml_quants import BLOCK_SIZES
    from kvlab.model.quantized import QuantizedMatrix

    rng = np.random.default_rng(seed)
    cols = 4608 if wide else n_blocks * BLOCK_SIZES[type_name][0]
    matrix = QuantizedMatrix.from_blocks(type_name, blocks(type_name, out, cols, rng, "normal"), (out, cols))
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    together = matrix.matmul_t(x, True, "q8")
    for i in range(rows):
        alone = matrix.matmul_t(x[i:i + 1], True, "q8")
        assert np.array_equal(together[i], alone[0]), (i, float(np.abs(together[i] - alone[0]).max()))
    shifted = matrix.matmul_t(x[1:], True, "q8")  # every row moves to another place in its block of rows
    assert np.array_equal(shifted, together[1:])
    want = rounded(x, matrix.group).astype(np.float64) @ matrix.dequantize(np.float64).T
    assert np.allclose(together, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())


@needs_numba
@settings(max_examples=25, deadline=None)
@given(head_dim=st.sampled_from([16, 32, 64, 128]), kv_heads=st.integers(1, 3), group=st.integers(1, 4),
       length=st.integers(1, 700), block_size=st.sampled_from([1, 3, 8, 16, 32, 50]),
       half=st.booleans(), data=st.data(), seed=st.integers(0, 2**16))
def test_a_rows_attention_ignores_block_size_company_and_threads(head_dim, kv_heads, group, length, block_size,
                                                                  half, data, seed):
    """Paged (any block size) == contiguous, bit for bit, for query rows of any key range (spans of 256
    keys, the split-K and the one-item-per-row schedules); a row alone == the row among others; one
    thread == two."""
    import numba

    from kvlab.kernels.attention import paged_decode_attention
    from kvlab.kernels.bits import as_kernel_array

    rng = np.random.default_rng(seed)
    keys = rng.standard_normal((1, kv_heads, length, head_dim)).astype(np.float32)
    values = rng.standard_normal((1, kv_heads, length, head_dim)).astype(np.float32)
    if half:  # a float16 cache: rows widened into a tile before the products
        keys, values = keys.astype(np.float16), values.astype(np.float16)
    rows = data.draw(st.integers(1, 5), label="query rows")
    ends = np.array([data.draw(st.integers(1, length), label="end") for _ in range(rows)], dtype=np.int64)
    starts = np.array([data.draw(st.integers(0, int(e) - 1), label="start") for e in ends], dtype=np.int64)
    q = rng.standard_normal((rows, kv_heads * group, head_dim)).astype(np.float32)

    def run(k: np.ndarray, v: np.ndarray, table: np.ndarray, which: slice = slice(None)) -> np.ndarray:
        tables = np.repeat(table, rows, axis=0)[which]
        k, v = (as_kernel_array(x) if half else x for x in (k, v))
        return paged_decode_attention(q[which], k, v, tables, ends[which], starts[which])

    contiguous = run(keys[0][None], values[0][None], np.zeros((1, 1), dtype=np.int64))
    k_blocks, table = paged_copy(keys, block_size, np.random.default_rng(seed))
    v_blocks, same = paged_copy(values, block_size, np.random.default_rng(seed))  # the same block order
    assert np.array_equal(table, same)
    assert np.array_equal(run(k_blocks, v_blocks, table), contiguous)
    last = slice(rows - 1, rows)
    assert np.array_equal(run(k_blocks, v_blocks, table, last), contiguous[last])
    threads = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        assert np.array_equal(run(keys[0][None], values[0][None], np.zeros((1, 1), dtype=np.int64), last),
                              contiguous[last])
    finally:
        numba.set_num_threads(threads)
    want = reference(q, keys.astype(np.float32), values.astype(np.float32), starts, ends)
    assert np.abs(contiguous - want).max() <= 1e-5 * (1 + np.abs(want).max())


def reference(q: np.ndarray, keys: np.ndarray, values: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    from kvlab.kernels.attention import decode_attention_reference

    return np.concatenate([decode_attention_reference(q[i:i + 1], keys, values, int(s), int(e))
                           for i, (s, e) in enumerate(zip(starts, ends))])


# --- a model with int8 activations ----------------------------------------------------------------------
@pytest.fixture(scope="module", params=[16, 32], ids=["head_dim16", "head_dim32"])
def q8_model(request, tmp_path_factory):
    """A Q8_0 GGUF model in the int8-activation mode, head dim 16 (the kernels' numba loops) or 32 (their
    vector code). One type, not a mix: every type's rows are held to batch invariance alone
    (test_an_integer_products_row_ignores_the_rows_beside_it) and a stack of types gives each part's bits
    (test_quantized_kernels.py), while a mixed file here compiled four fused-kernel variants of its own (80 s
    of a cold CI run); a Q8_0 file shares the ones the other tests' Q8_0 files compile."""
    import kvlab
    from gguf_files import small_config, write_gguf

    path = tmp_path_factory.mktemp("invariant") / "m.gguf"
    write_gguf(path, small_config("llama", hidden_size=4 * request.param, max_position_embeddings=160),
               types=("Q8_0",))
    model, _ = kvlab.load(path, backend="numba", activations="q8")
    assert model.ops.batch_invariant
    return model


@needs_numba
@settings(max_examples=15, deadline=None)
@given(data=st.data(), seed=st.integers(0, 2**16), kv_dtype=st.sampled_from([None, "float16", "int8"]))
def test_cached_chunks_give_a_full_recomputes_bits(q8_model, data, seed, kv_dtype):
    """Any chunk schedule through a cache (float32: against the forward with no cache; float16 and int8,
    whose rows read back rounded: against the same cache filled in one prefill) and a batch of
    sequences: the logits are equal, not close."""
    model = q8_model
    rng = np.random.default_rng(seed)
    length = data.draw(st.integers(2, 150), label="length")
    ids = rng.integers(0, model.config.vocab_size, (2, length))
    if kv_dtype is None:
        want = model.forward(ids, use_cache=False).logits
    else:
        want = model.forward(ids, cache=model.new_cache(2, kv_dtype=kv_dtype, capacity=length)).logits
    cache, got, at = model.new_cache(2, kv_dtype=kv_dtype, capacity=length), [], 0
    while at < length:
        step = data.draw(st.integers(1, length - at), label="chunk")
        got.append(model.forward(ids[:, at:at + step], cache=cache).logits)
        at += step
    assert np.array_equal(np.concatenate(got, axis=1), want)
    if kv_dtype is None:  # a row of the batch == the sequence alone
        assert np.array_equal(model.forward(ids[1:], use_cache=False).logits[0], want[1])


@needs_numba
def test_verify_holds_the_q8_mode_to_equality(q8_model):
    """`kvlab verify`'s schedules (decode, chunks, batch, fork, crop, paged, the engine with preemption
    and a warm prefix cache, speculation): every check's error is exactly 0, the engine's too (they
    compare the logprobs its sampler computed with the recompute's through the same log-softmax,
    sampler.log_probs: before, the verifier's own float32 log-softmax left 1e-7 between equal logits)."""
    from kvlab.verify import verify_model

    results = {r.name: r for r in verify_model(q8_model)}
    assert all(r.passed for r in results.values()), {n: r.max_abs_error for n, r in results.items()}
    for name in ("decode", "chunks", "batch", "fork", "crop", "paged", "engine", "speculative",
                 "speculative-draft"):
        assert results[name].max_abs_error == 0.0, name


@needs_numba
def test_the_exact_mode_is_not_batch_invariant_and_says_so(q8_model):
    """The negative control: the exact products (BLAS bands for a prefill, the fused kernels for a
    decode) sum in different orders, so the same checks there are close, not equal, which is why only
    the q8 mode routes prefill attention through the decode kernel."""
    model = q8_model
    model.set_activations(None)
    try:
        assert not model.ops.batch_invariant
        ids = np.random.default_rng(0).integers(0, model.config.vocab_size, (1, 80))
        cache = model.new_cache(1)
        steps = [model.forward(ids[:, :70], cache=cache).logits]
        steps += [model.forward(ids[:, i:i + 1], cache=cache).logits for i in range(70, 80)]
        want = model.forward(ids, use_cache=False).logits
        got = np.concatenate(steps, axis=1)
        assert not np.array_equal(got, want)
        assert np.abs(got - want).max() <= 1e-4 * (1 + np.abs(want).max())
    finally:
        model.set_activations("q8")
