"""Decode attention over every cache format read in place (float rows, int8/int4/fp8 codes with their
scales) against the NumPy reference on the same stored values, and the compiled cache writer against the
NumPy codec bit for bit; then the model and the engine with quantized caches on the compiled path."""

import ml_dtypes
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvlab import Engine, LlamaModel, SamplingParams
from kvlab.cache.dtypes import resolve_kv_dtype
from kvlab.cache.quant import FP8_DTYPES, decode_rows, encode_rows
from kvlab.config import ModelConfig
from kvlab.kernels import AVAILABLE
from test_kernels import threshold   # the parallel or the single-threaded attention kernel, forced

pytestmark = pytest.mark.skipif(not AVAILABLE, reason="numba is not installed")

if AVAILABLE:
    from kvlab.kernels import attention
    from kvlab.kernels.attention_encode import write_codes
    from kvlab.kernels.attention_formats import StoredCodes, kind_of
    from kvlab.kernels.bits import BFLOAT16

FLOATS = ["float32", "float16", "bfloat16"]
CODES = ["int8", "int4", "fp8_e4m3", "fp8_e5m2"]



def stored_as(x: np.ndarray, name: str) -> tuple[object, np.ndarray]:
    """x [blocks, H, rows, d] stored in cache format `name`, and the float32 values the store holds (what
    the reference attends to): float rows, or codes encoded by the NumPy codec and decoded again."""
    if name in FLOATS:
        rows = x.astype(BFLOAT16 if name == "bfloat16" else np.dtype(name))
        return rows, rows.astype(np.float32)
    fmt = resolve_kv_dtype(name, np.float32)
    group = fmt.group(x.shape[-1])
    codes, scale, zero = encode_rows(x, fmt, group)
    if scale is None:
        scale = zero = np.zeros(x.shape[:3] + (0,), np.float16)
    return (StoredCodes(codes, scale, zero, kind_of(name), group),
            decode_rows(codes, scale, zero, fmt, group, np.float32))


@settings(max_examples=40)
@given(batch=st.integers(1, 3), kv_heads=st.integers(1, 3), group=st.sampled_from([1, 2, 4, 8]),
       head_dim=st.sampled_from([8, 32, 64, 96, 128]), cache=st.sampled_from(FLOATS + CODES), data=st.data(),
       parallel=st.booleans(), seed=st.integers(0, 2**16))
def test_contiguous_decode_reads_every_format_in_place(batch, kv_heads, group, head_dim, cache, data, parallel,
                                                       seed):
    """Lengths around tile (32) and span (256) edges, windows (start > 0), spare capacity past the end."""
    rng = np.random.default_rng(seed)
    length = data.draw(st.one_of(st.integers(1, 80), st.sampled_from([31, 32, 33, 255, 256, 257, 300])),
                       label="length")
    start = data.draw(st.one_of(st.just(0), st.integers(0, length - 1)), label="start (window)")
    capacity = length + data.draw(st.integers(0, 9), label="spare capacity")
    shape = (batch, kv_heads, capacity, head_dim)
    keys, k_values = stored_as(2 * rng.standard_normal(shape).astype(np.float32), cache)
    values, v_values = stored_as(rng.standard_normal(shape).astype(np.float32), cache)
    q = (2 * rng.standard_normal((batch, kv_heads * group, head_dim))).astype(np.float32)
    with threshold(0 if parallel else 10**9):
        got = attention.decode_attention(q, keys, values, start, length)
    want = attention.decode_attention_reference(q, k_values, v_values, start, length)
    assert got.shape == want.shape and got.dtype == np.float32
    assert np.abs(got - want).max() <= 2e-6 * head_dim


@settings(max_examples=40)
@given(num_seqs=st.integers(1, 4), kv_heads=st.integers(1, 2), group=st.sampled_from([1, 2, 4, 8]),
       head_dim=st.sampled_from([8, 64]), block_size=st.sampled_from([1, 16, 32, 48]),
       cache=st.sampled_from(FLOATS + CODES), data=st.data(), parallel=st.booleans(),
       seed=st.integers(0, 2**16))
def test_paged_decode_reads_every_format_in_place(num_seqs, kv_heads, group, head_dim, block_size, cache, data,
                                                  parallel, seed):
    """Shuffled block tables, sequences of different lengths (and windows) in one call."""
    rng = np.random.default_rng(seed)
    lens = data.draw(st.lists(st.integers(1, 300), min_size=num_seqs, max_size=num_seqs), label="lengths")
    starts = [data.draw(st.one_of(st.just(0), st.integers(0, n - 1)), label="start") for n in lens]
    max_blocks = max(-(-n // block_size) for n in lens)
    num_blocks = num_seqs * max_blocks + 3
    order = rng.permutation(num_blocks)  # a block pool handed out in no particular order
    tables = np.zeros((num_seqs, max_blocks), dtype=np.int64)
    used = 0
    for s, n in enumerate(lens):
        count = -(-n // block_size)
        tables[s, :count] = order[used:used + count]
        used += count
    shape = (num_blocks, kv_heads, block_size, head_dim)
    k_blocks, k_values = stored_as(rng.standard_normal(shape).astype(np.float32), cache)
    v_blocks, v_values = stored_as(rng.standard_normal(shape).astype(np.float32), cache)
    q = rng.standard_normal((num_seqs, kv_heads * group, head_dim)).astype(np.float32)
    with threshold(0 if parallel else 10**9):
        got = attention.paged_decode_attention(q, k_blocks, v_blocks, tables, lens, starts)
    want = attention.paged_decode_attention_reference(q, k_values, v_values, tables, lens, starts)
    assert np.abs(got - want).max() <= 2e-6 * head_dim


def test_decode_refuses_keys_and_values_stored_differently():
    keys, _ = stored_as(np.ones((1, 1, 4, 8), np.float32), "int8")
    values, _ = stored_as(np.ones((1, 1, 4, 8), np.float32), "fp8_e4m3")
    with pytest.raises(ValueError, match="stored alike"):
        attention.decode_attention(np.ones((1, 1, 8), np.float32), keys, values, 0, 4)


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_codes_widen_exactly(name):
    """One key per sequence: the output is the stored value row, so each finite fp8 code (normals,
    subnormals, signed zeros) must widen to exactly its value."""
    dtype = FP8_DTYPES[name]
    codes = np.arange(256, dtype=np.uint8).view(dtype)
    codes = codes[np.isfinite(codes.astype(np.float32))]
    rows = -(-codes.size // 8)
    padded = np.zeros(rows * 8, dtype=dtype)
    padded[:codes.size] = codes
    values = StoredCodes(padded.reshape(rows, 1, 1, 8), *(np.zeros((rows, 1, 1, 0), np.float16),) * 2,
                         kind_of(name), 8)
    keys = StoredCodes(np.ones((rows, 1, 1, 8), dtype), values.scale, values.zero, kind_of(name), 8)
    got = attention.decode_attention(np.ones((rows, 2, 8), np.float32), keys, values, 0, 1)
    want = padded.astype(np.float32).reshape(rows, 8)
    assert np.array_equal(got[:, 0], want) and np.array_equal(got[:, 1], want)


# --- the compiled writer is the codec ----------------------------------------------------------------
@settings(max_examples=60)
# found by a random draw: a group whose least values are 0.0 and -0.0 (NumPy's min gave -0.0, the writer 0.0)
@example(name="int8", compute="float16", head_dim=8, magnitude=1e-7, zeros=False, seed=4)
@given(name=st.sampled_from(CODES), compute=st.sampled_from(["float32", "float64", "float16"]),
       head_dim=st.sampled_from([8, 32, 64, 96]), magnitude=st.sampled_from([1e-7, 1e-3, 1.0, 300.0, 5e3]),
       zeros=st.booleans(), seed=st.integers(0, 2**16))
def test_compiled_writer_equals_the_numpy_codec_bit_for_bit(name, compute, head_dim, magnitude, zeros, seed):
    """Codes, float16 scales and zeros as `encode_rows` makes them, over magnitudes from float16's
    subnormals to near its largest value (the codec's domain), signed zeros included."""
    rng = np.random.default_rng(seed)
    x = (magnitude * rng.standard_normal((5, 3, head_dim))).astype(compute)
    if zeros:
        x[0, 0] = 0.0
        x[1, 1] = -0.0
        x[2, 2, : head_dim // 2] = 0.0
    fmt = resolve_kv_dtype(name, np.float32)
    group = fmt.group(head_dim)
    codes, scale, zero = encode_rows(x, fmt, group)
    groups = 0 if scale is None else head_dim // group
    blocks, rows = rng.permutation(7)[:5], rng.integers(0, 4, 5)
    stored = StoredCodes(np.zeros((7, 3, 4, codes.shape[-1]), codes.dtype), np.zeros((7, 3, 4, groups), np.float16),
                         np.zeros((7, 3, 4, groups), np.float16), kind_of(name), group)
    write_codes(stored, blocks, rows, x)
    assert np.array_equal(stored.codes[blocks, :, rows].view(np.uint8), codes.view(np.uint8))
    if scale is not None:
        assert np.array_equal(stored.scale[blocks, :, rows].view(np.uint16), scale.view(np.uint16))
        assert np.array_equal(stored.zero[blocks, :, rows].view(np.uint16), zero.view(np.uint16))


def test_compiled_fp8_writer_rounds_every_float16_value_as_ml_dtypes():
    """Every finite float16 value (a superset of both fp8 grids and the ties between their points)."""
    values = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)
    values = values[np.isfinite(values)]
    x = np.zeros((values.size // 64 + 1) * 64, np.float32)
    x[:values.size] = values
    x = x.reshape(-1, 1, 64)
    for name in ("fp8_e4m3", "fp8_e5m2"):
        fmt = resolve_kv_dtype(name, np.float32)
        stored = StoredCodes(np.zeros((x.shape[0], 1, 1, 64), FP8_DTYPES[name]),
                             *(np.zeros((x.shape[0], 1, 1, 0), np.float16),) * 2, kind_of(name), 64)
        write_codes(stored, np.arange(x.shape[0]), np.zeros(x.shape[0], np.int64), x)
        want = encode_rows(x, fmt, 64)[0]
        assert np.array_equal(stored.codes[:, :, 0].view(np.uint8), want.view(np.uint8))
        assert ml_dtypes.finfo(FP8_DTYPES[name]).max == np.abs(stored.codes.astype(np.float32)).max()


# --- through the model and the engine ------------------------------------------------------------------
def model_pair() -> tuple[LlamaModel, LlamaModel]:
    config = ModelConfig(vocab_size=97, hidden_size=128, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=512)
    from kvlab.model.weights import random_weights
    weights = random_weights(config, 4, np.float64)
    return tuple(LlamaModel(config, weights, dtype=np.float64, backend=b) for b in ("numba", "numpy"))


@pytest.fixture(scope="module")
def models():
    return model_pair()


@pytest.mark.parametrize("kv_dtype", CODES)
def test_quantized_cache_decodes_in_place_as_the_numpy_backend(models, kv_dtype):
    """Prefill (dequantized copies) then decode steps that read the codes in place and write them with the
    compiled codec: the logits of the NumPy backend, which dequantizes every step. In float64, so that no
    rounding upstream moves a code: what is left is the order of the sums."""
    compiled, reference = models
    ids = np.random.default_rng(1).integers(0, 97, size=(2, 70))
    logits = []
    for model in (compiled, reference):
        cache = model.new_cache(2, kv_dtype=kv_dtype)
        out = [model.forward(ids[:, :40], cache=cache).logits]
        out += [model.forward(ids[:, i:i + 1], cache=cache).logits for i in range(40, 70)]
        logits.append(np.concatenate(out, axis=1))
        if model is compiled:
            from kvlab.model.attention import ContiguousAttention

            step = ContiguousAttention(cache, np.array([70]), 2, model.config, True, np.float64)
            assert step.in_place and all(plan.decode is not None for plan in step.layer_plans)  # codes read in place
    assert np.abs(logits[0] - logits[1]).max() <= 1e-9 * max(1.0, np.abs(logits[1]).max())


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e5m2"])
def test_engine_decodes_quantized_blocks_in_place_as_the_numpy_backend(models, kv_dtype):
    compiled, reference = models
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 97, n).tolist() for n in (5, 40, 77)]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    outs = [[o.outputs[0].token_ids for o in Engine(m, block_size=16, kv_cache_dtype=kv_dtype).generate(prompts, params)]
            for m in (compiled, reference)]
    assert outs[0] == outs[1]
