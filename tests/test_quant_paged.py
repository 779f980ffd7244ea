"""Quantized K/V in the block pool: rows and scales move together through slots, copy-on-write and prefix
hits, the engine's tokens match the contiguous quantized cache, and prefix keys separate precisions."""

import numpy as np
import pytest

from kvlab import Engine, InputError, SamplingParams, TinyLlama, generate
from kvlab.cache.kv_cache import resolve_kv_dtype
from kvlab.cache.paged import BlockPool, gather_blocks, write_slots
from kvlab.cache.quant import decode_rows, encode_rows
from kvlab.prefix.block_hash import root_key

GREEDY = dict(ignore_eos=True)


@pytest.mark.parametrize("name", ["int8", "int4", "fp8_e4m3", "fp8_e5m2"])
def test_pool_slots_round_trip_through_the_codec(name):
    fmt = resolve_kv_dtype(name, np.float32)
    pool = BlockPool(2, 2, 32, fmt, block_size=4, num_blocks=6, compute_dtype=np.float32)
    rng = np.random.default_rng(0)
    keys, values = (rng.standard_normal((10, 2, 32)).astype(np.float32) for _ in range(2))
    table = [5, 1, 3]  # 10 positions over three scattered blocks
    slots = np.array([table[p // 4] * 4 + p % 4 for p in range(10)])
    write_slots(pool.key_cache[1], pool.value_cache[1], slots, keys, values)
    got_k = gather_blocks(pool.key_cache[1], np.array([table]), 10)
    got_v = gather_blocks(pool.value_cache[1], np.array([table]), 10)
    for got, x in [(got_k, keys), (got_v, values)]:
        want = decode_rows(*encode_rows(x, fmt, 32), fmt, 32, np.float32)  # [10, H, d]
        assert got.dtype == np.float32 and got.shape == (1, 2, 10, 32)
        assert np.array_equal(got[0].transpose(1, 0, 2), want)
        assert 0 < np.abs(got[0].transpose(1, 0, 2) - x).max() < 0.5
    pool_f32 = BlockPool(2, 2, 32, np.float32, block_size=4, num_blocks=6)
    ratio = pool.bytes_per_block / pool_f32.bytes_per_block
    assert ratio == {"int8": 0.28125, "int4": 0.15625}.get(name, 0.25)  # scales counted


def test_copy_on_write_copies_codes_with_their_scales():
    fmt = resolve_kv_dtype("int4", np.float64)
    pool = BlockPool(1, 1, 8, fmt, block_size=4, num_blocks=3, compute_dtype=np.float64)
    rows = np.random.default_rng(1).standard_normal((4, 1, 8))
    write_slots(pool.key_cache[0], pool.value_cache[0], np.arange(4), rows, rows * 3)
    pool.copy_block(0, 2, 3)
    for cache in (pool.key_cache[0], pool.value_cache[0]):
        src, dst = (gather_blocks(cache, np.array([[b]]), 3) for b in (0, 2))
        assert np.array_equal(src, dst)


@pytest.fixture(scope="module")
def model():
    return TinyLlama(seed=5, head_dim=16, num_attention_heads=2, hidden_size=32)


@pytest.mark.parametrize("kv_dtype", ["int8", "int4", "fp8_e5m2"])
def test_engine_tokens_equal_the_contiguous_quantized_cache(model, kv_dtype):
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 256, n).tolist() for n in (5, 23, 40)]
    engine = Engine(model, block_size=8, kv_cache_dtype=kv_dtype)
    outs = engine.generate(prompts, SamplingParams(max_tokens=12, **GREEDY))
    for prompt, out in zip(prompts, outs):
        want = generate(model, [prompt], 12, kv_dtype=kv_dtype)[0].tolist()
        assert out.outputs[0].token_ids == want
    assert engine.block_pool.num_used_blocks == 0
    assert engine.cache_state()["capacity_bytes"] < Engine(model, block_size=8).cache_state()["capacity_bytes"]


def test_prefix_hits_in_a_quantized_pool_and_keys_that_separate_precisions(model):
    rng = np.random.default_rng(3)
    prefix = rng.integers(0, 256, 32).tolist()
    engine = Engine(model, block_size=8, kv_cache_dtype="int8")
    engine.generate([prefix + [1, 2]], SamplingParams(max_tokens=3, **GREEDY))
    [hit] = engine.generate([prefix + [7, 7, 7]], SamplingParams(max_tokens=8, **GREEDY))
    cold = generate(model, [prefix + [7, 7, 7]], 8, kv_dtype="int8")[0].tolist()
    assert hit.num_cached_tokens == 32 and hit.outputs[0].token_ids == cold
    keys = {root_key(model.fingerprint, model.dtype, resolve_kv_dtype(d, model.dtype))
            for d in ["float64", "float32", "int8", "int4", "fp8_e4m3", "fp8_e5m2"]}
    assert len(keys) == 6


def test_per_channel_keys_are_refused_by_the_pool(model):
    with pytest.raises(InputError, match="per-channel key groups"):
        Engine(model, kv_cache_dtype="int4-channel")
