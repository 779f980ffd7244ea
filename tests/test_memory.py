"""K/V memory accounting: the formula 2 * L * B * H_kv * T * d * b, worked by hand, and the live report."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvlab import InputError, ModelConfig, TinyLlama
from kvlab.cache.memory import canonical_dtype, kv_bytes_per_token, kv_payload_bytes, tokens_in_budget

# 3 layers x 5 KV heads x head_dim 6: per token 2 * 3 * 5 * 6 = 180 scalars
CONFIG = ModelConfig(vocab_size=50, hidden_size=16, intermediate_size=8, num_hidden_layers=3,
                     num_attention_heads=10, num_key_value_heads=5, head_dim=6)


@pytest.mark.parametrize("name,bytes_per_token", [
    ("float64", 1440), ("fp64", 1440), ("FLOAT32", 720), ("fp32", 720), ("float16", 360), ("half", 360),
    ("fp16", 360), ("bf16", 360), ("bfloat16", 360), ("fp8", 180), ("float8", 180), ("fp8_e4m3", 180),
    ("fp8_e5m2", 180), ("int8", 180), ("int4", 90),
])
def test_bytes_per_token_for_every_dtype_name(name: str, bytes_per_token: int) -> None:
    assert kv_bytes_per_token(CONFIG, name) == bytes_per_token


def test_defaults_are_float64_and_batch_one() -> None:
    assert kv_bytes_per_token(CONFIG) == 1440
    assert kv_payload_bytes(CONFIG, 7) == 1440 * 7
    assert kv_payload_bytes(CONFIG, 7, 3) == 1440 * 21
    assert kv_payload_bytes(CONFIG, 7, 3, "fp16") == 360 * 21
    assert tokens_in_budget(CONFIG, 1440 * 10 + 1439) == 10
    assert tokens_in_budget(CONFIG, 1440 * 10, 2) == 5
    assert tokens_in_budget(CONFIG, 360 * 9, 3, "float16") == 3
    assert type(tokens_in_budget(CONFIG, 10**6)) is int
    # floor division in integers: a float quotient would round 2**53 - 1/1440 up to 2**53
    assert tokens_in_budget(CONFIG, 1440 * 2**53 - 1) == 2**53 - 1


def test_unknown_dtype_names_the_choices() -> None:
    assert canonical_dtype("BF16") == "bfloat16"
    with pytest.raises(ValueError, match=r"unknown cache dtype 'float7'; choose from float64, float32, "):
        canonical_dtype("float7")


def test_live_report_of_a_grown_and_cropped_cache() -> None:
    model = TinyLlama(seed=7)  # 512 B per token in float64: 2 layers x 2 KV heads x 8 x 8 B x 2
    cache = model.forward(np.arange(20)[None], use_cache=True).cache
    cache.crop(13)
    report = cache.memory_report()
    assert (report.num_layers, report.batch_size, report.num_tokens, report.dtype) == (2, 1, 13, "float64")
    assert report.payload_bytes == 13 * 512 == kv_payload_bytes(model.config, 13)
    assert report.capacity_tokens == cache.store.capacity_tokens >= 20
    assert report.capacity_bytes == report.capacity_tokens * 512
    assert report.metadata_bytes == cache._positions.nbytes == 8 * cache._positions.shape[0]
    assert report.total_bytes == report.capacity_bytes + report.metadata_bytes
    data = json.loads(json.dumps(report.to_dict()))
    assert data == {"num_layers": 2, "batch_size": 1, "num_tokens": 13, "capacity_tokens":
                    report.capacity_tokens, "dtype": "float64", "payload_bytes": 6656,
                    "capacity_bytes": report.capacity_bytes, "metadata_bytes": report.metadata_bytes,
                    "total_bytes": report.total_bytes, "scale_bytes": 0}  # a float cache keeps no scales
    half = model.new_cache(batch_size=2, kv_dtype="bf16")
    model.forward(np.arange(10).reshape(2, 5), cache=half)
    report = half.memory_report()
    assert (report.dtype, report.batch_size, report.payload_bytes) == ("bfloat16", 2, 2 * 5 * 128)


def test_cache_repr_names_its_shape_and_model() -> None:
    model = TinyLlama(seed=7)
    cache = model.new_cache(kv_dtype="float16")
    model.forward(np.arange(3)[None], cache=cache)
    assert repr(cache) == (f"KVCache(layers=2, batch=1, tokens=3, dtype=float16, "
                           f"fingerprint={model.fingerprint[:12]})")


def test_layer_indexing_and_crop_errors_name_the_problem() -> None:
    model = TinyLlama(seed=7)
    cache = model.forward(np.arange(4)[None], use_cache=True).cache
    assert cache[-2][0].tobytes() == cache[0][0].tobytes()
    assert cache[1][1].tobytes() == cache[-1][1].tobytes()
    for bad in (2, -3):
        with pytest.raises(IndexError, match=rf"^layer {bad} out of range for a 2-layer cache$"):
            cache[bad]
    with pytest.raises(InputError, match=r"^crop length must be an int, got 2\.0$"):
        cache.crop(2.0)
    with pytest.raises(InputError, match="^cannot crop a cache of 4 tokens to 5$"):
        cache.crop(5)
    assert cache.get_seq_length() == 4


def test_capacity_doubles_and_never_drops_below_the_minimum() -> None:
    from kvlab.cache.contiguous import ContiguousStore
    store = ContiguousStore(1, 1, 1, 2, np.float64, capacity=1)
    store.reserve(2)
    assert store.capacity_tokens == 16  # MIN_CAPACITY, not 2 x 1
    store.reserve(17)
    assert store.capacity_tokens == 32  # doubled, not tripled
    store.reserve(100)
    assert store.capacity_tokens == 100  # a big jump takes exactly what is asked


def test_incompatible_caches_are_named_exactly() -> None:
    from kvlab import CacheMismatchError
    model, other = TinyLlama(seed=7), TinyLlama(seed=8)
    cache = model.new_cache()
    with pytest.raises(CacheMismatchError, match=(
            rf"^this cache was produced by a different model \(fingerprint {model.fingerprint[:12]} vs the "
            rf"model's {other.fingerprint[:12]}\): cached keys and values are only valid for the exact "
            "weights, config and dtype that computed them$")):
        cache.check_compatible(other.cache_spec, 1)
    spec32 = type(model.cache_spec)(**{**model.cache_spec.__dict__, "compute_dtype": np.dtype(np.float32)})
    with pytest.raises(CacheMismatchError, match="^cache computed in float64, model runs in float32$"):
        cache.check_compatible(spec32, 1)
