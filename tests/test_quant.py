"""Quantized K/V: codecs within their bounds, the quantized store against the float one, and the cache
operations (fork, crop, session files) that must work on it or refuse it."""

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, strategies as st
from hypothesis.extra.numpy import arrays

from kvlab import CacheMismatchError, InputError, Session, TinyLlama
from kvlab.cache.kv_cache import KVCache, resolve_kv_dtype
from kvlab.cache.quant import (FP8_DTYPES, QuantFormat, dequantize_int, pack_int4, quantize_fp8, quantize_int,
                               unpack_int4)
from kvlab.sessions.persist import write_session_file

finite = st.floats(-1000, 1000, allow_nan=False, width=32)


def fp8_error_bound(x: np.ndarray, name: str) -> np.ndarray:
    """Largest |x - fp8(x)| for values within range: half an ulp, relative for normals, absolute below."""
    info = ml_dtypes.finfo(FP8_DTYPES[name])
    return np.maximum(np.abs(x) * float(info.eps) / 2, float(info.smallest_subnormal) / 2)


@given(arrays(np.float32, st.tuples(st.integers(1, 4), st.integers(1, 6), st.sampled_from([2, 8, 32])),
              elements=finite), st.sampled_from([8, 4]), st.sampled_from([-1, -2]))
def test_int_round_trip_is_within_half_a_step(x, bits, axis):
    codes, scale, zero = quantize_int(x, bits, axis)
    assert codes.dtype == np.uint8 and codes.max() <= (1 << bits) - 1
    assert scale.dtype == zero.dtype == np.float16 and scale.shape[axis] == 1
    back = dequantize_int(codes, scale, zero, np.float64)
    bound = scale.astype(np.float64) / 2 * (1 + 1e-6) + 1e-9 * np.abs(x)
    assert np.all(np.abs(back - x) <= bound)
    # zero sits at most one float16 step below the minimum, and the step is no coarser than the range
    # from zero to the maximum allows (float16 rounding of the scale aside)
    lo, hi = x.min(axis=axis, keepdims=True), x.max(axis=axis, keepdims=True).astype(np.float64)
    assert np.all((zero <= lo) & (lo - zero <= np.spacing(np.abs(lo).astype(np.float16)).astype(np.float64)))
    assert np.all(scale <= (hi - zero) / ((1 << bits) - 1) * 1.002 + 1e-7)


@given(arrays(np.uint8, st.tuples(st.integers(1, 3), st.sampled_from([2, 8, 32])),
              elements=st.integers(0, 15)))
def test_int4_packing_round_trips(codes):
    packed = pack_int4(codes)
    assert packed.shape[-1] == codes.shape[-1] // 2
    assert np.array_equal(unpack_int4(packed), codes)


@given(arrays(np.float32, st.integers(1, 64), elements=st.floats(-400, 400, allow_nan=False, width=32)),
       st.sampled_from(sorted(FP8_DTYPES)))
def test_fp8_round_trip_is_within_half_an_ulp(x, name):
    back = quantize_fp8(x, name).astype(np.float64)
    assert np.all(np.abs(back - x) <= fp8_error_bound(x, name) * (1 + 1e-9))


def test_fp8_saturates_instead_of_overflowing():
    big = np.array([1e6, -1e6, 500.0], dtype=np.float32)
    out = quantize_fp8(big, "fp8_e4m3").astype(np.float32)
    assert np.all(np.isfinite(out)) and out[0] == 448 and out[1] == -448
    assert np.isfinite(quantize_fp8(np.float32([1e9]), "fp8_e5m2").astype(np.float32)).all()


def test_cache_dtype_names():
    for name, bits in [("int8", 8), ("int4", 4), ("int4_channel", 4), ("fp8", 8), ("fp8_e5m2", 8)]:
        fmt = resolve_kv_dtype(name, np.float32)
        assert isinstance(fmt, QuantFormat) and fmt.bits == bits
    assert resolve_kv_dtype("fp8", np.float32).name == "fp8_e4m3"
    assert resolve_kv_dtype("int4-channel", np.float32).key_grouping == "channel"
    assert resolve_kv_dtype("bf16", np.float32) == np.dtype(ml_dtypes.bfloat16)
    for bad in ["int3", "int8-rows", "fp8_e3m4", "q2"]:
        with pytest.raises(InputError, match="cache dtype|key grouping"):
            resolve_kv_dtype(bad, np.float32)


def _model():
    return TinyLlama(seed=5, dtype=np.float32, hidden_size=64, head_dim=32, num_attention_heads=2,
                     num_key_value_heads=1, max_position_embeddings=128)


@pytest.mark.parametrize("kv_dtype", ["int8", "int4", "fp8_e4m3", "fp8_e5m2", "int8-channel", "int4-channel"])
def test_quantized_cache_stores_rows_within_the_codec_bound(kv_dtype):
    model = _model()
    ids = np.random.default_rng(0).integers(0, 256, (1, 70))
    exact = model.new_cache()
    model.forward(ids, cache=exact)
    lossy = model.new_cache(kv_dtype=kv_dtype)
    model.forward(ids, cache=lossy)
    fmt = lossy.dtype
    keys, values = exact[0]
    q_keys, q_values = lossy[0]  # layer 0's rows depend only on token and position: same inputs
    assert q_keys.dtype == np.float32 and q_keys.shape == keys.shape
    for x, y in [(keys, q_keys), (values, q_values)]:
        err = np.abs(x - y)
        if fmt.is_float:
            assert np.all(err <= fp8_error_bound(x, fmt.name) * 1.001 + 1e-7)
        else:
            assert err.max() <= (x.max() - x.min()) / ((1 << fmt.bits) - 1)  # half a step of the widest group
            assert err.max() > 0
    if fmt.key_grouping == "channel":  # the partial last block (70 = 2 * 32 + 6) is kept as computed
        assert np.array_equal(q_keys[:, :, 64:], keys[:, :, 64:])


def test_int8_bytes_with_scales_are_under_30_percent_of_float32():
    model = _model()
    ids = np.random.default_rng(1).integers(0, 256, (1, 64))
    reports = {}
    for kv_dtype in ["float32", "int8", "int4", "fp8"]:
        cache = model.new_cache(kv_dtype=kv_dtype)
        model.forward(ids, cache=cache)
        reports[kv_dtype] = cache.memory_report()
    per_row = 2 * 2 * 1 * 32  # K and V, 2 layers, 1 KV head, head_dim 32
    assert reports["float32"].payload_bytes == per_row * 64 * 4
    assert reports["int8"].payload_bytes == per_row * 64 and reports["int8"].scale_bytes == per_row * 64 // 8
    assert reports["int4"].payload_bytes == per_row * 32 and reports["int4"].scale_bytes == per_row * 64 // 8
    assert reports["fp8"].scale_bytes == 0
    int8_total = reports["int8"].payload_bytes + reports["int8"].scale_bytes
    assert int8_total / reports["float32"].payload_bytes == pytest.approx(0.28125)
    assert reports["int8"].metadata_bytes >= reports["int8"].scale_bytes


@pytest.mark.parametrize("kv_dtype", ["int8", "int4", "int4-channel", "fp8_e5m2"])
def test_fork_copies_codes_exactly_and_branches_independently(kv_dtype):
    model = _model()
    rng = np.random.default_rng(2)
    prefix, a, b = (rng.integers(0, 256, (1, n)) for n in (40, 5, 7))
    cache = model.new_cache(kv_dtype=kv_dtype)
    model.forward(prefix, cache=cache)
    fork = cache.fork()
    assert fork.dtype == cache.dtype and fork.memory_report().scale_bytes == cache.memory_report().scale_bytes
    for layer in range(2):
        assert all(np.array_equal(x, y) for x, y in zip(cache[layer], fork[layer]))
    out_a = model.forward(a, cache=cache).logits
    out_b = model.forward(b, cache=fork).logits
    again = model.new_cache(kv_dtype=kv_dtype)
    model.forward(prefix, cache=again)
    assert np.array_equal(model.forward(b, cache=again).logits, out_b)  # the fork never saw `a`
    assert out_a.shape[1] == 5


@pytest.mark.parametrize("kv_dtype", ["int8", "int4", "fp8_e4m3"])
def test_crop_then_extend_equals_a_fresh_run_for_token_grouped_rows(kv_dtype):
    model = _model()
    ids = np.random.default_rng(3).integers(0, 256, (1, 50))
    cache = model.new_cache(kv_dtype=kv_dtype)
    model.forward(ids[:, :30], cache=cache)
    model.forward(ids[:, 30:45], cache=cache)
    cache.crop(30)
    cropped = model.forward(ids[:, 30:50], cache=cache).logits
    fresh = model.new_cache(kv_dtype=kv_dtype)
    model.forward(ids[:, :30], cache=fresh)
    assert np.array_equal(model.forward(ids[:, 30:50], cache=fresh).logits, cropped)


def test_crop_inside_a_channel_block_reopens_it():
    model = _model()
    ids = np.random.default_rng(4).integers(0, 256, (1, 80))
    cache = model.new_cache(kv_dtype="int8-channel")
    model.forward(ids[:, :70], cache=cache)
    cache.crop(40)  # inside the second 32-token block
    keys_before = cache[0][0].copy()
    out = model.forward(ids[:, 40:80], cache=cache).logits
    assert np.array_equal(cache[0][0][:, :, :32], keys_before[:, :, :32])  # the first block is untouched
    reference = model.forward(ids).logits[:, 40:]
    assert np.abs(out - reference).max() < 0.05  # int8 damage, not garbage
    fresh = model.new_cache(kv_dtype="int8-channel")
    expected = model.forward(ids, cache=fresh).logits[:, 40:]
    assert np.abs(out - expected).max() < 0.05


def test_session_files_refuse_quantized_caches(tmp_path):
    model = _model()
    session = Session(model, kv_dtype="int8")
    session.feed([1, 2, 3])
    session.generate(2)
    path = tmp_path / "s.kvlab"
    with pytest.raises(InputError, match="int8 cache cannot be saved"):
        session.save(path)
    assert not path.exists() and not list(tmp_path.iterdir())
    with pytest.raises(InputError, match="cannot be saved"):
        write_session_file(path, session.cache, session.tokens, {})
    floats = Session(model)
    floats.feed([1, 2, 3])
    floats.generate(2)
    floats.save(path)
    with pytest.raises(CacheMismatchError):
        Session.load(path, model, kv_dtype="int4")


def test_from_arrays_quantizes_into_the_requested_format():
    model = _model()
    cache = model.new_cache()
    model.forward(np.arange(1, 20)[None], cache=cache)
    keys, values = zip(*cache)
    q = KVCache.from_arrays(model.cache_spec, keys, values, cache.positions, kv_dtype="int8")
    assert q.quantized and q.get_seq_length() == 19
    assert np.abs(q[1][0] - keys[1]).max() <= np.ptp(keys[1]) / 255


def test_kvlab_memory_formula_counts_the_scales_a_live_cache_holds():
    from kvlab.cache.memory import kv_bytes_per_token, kv_scale_bytes_per_token, tokens_in_budget

    model = _model()
    cache = model.new_cache(kv_dtype="int4")
    model.forward(np.arange(1, 41)[None], cache=cache)
    report = cache.memory_report()
    assert report.scale_bytes == 40 * kv_scale_bytes_per_token(model.config, "int4")
    assert report.payload_bytes == 40 * kv_bytes_per_token(model.config, "int4")
    per_token = (report.payload_bytes + report.scale_bytes) / 40
    assert tokens_in_budget(model.config, int(per_token * 100), 1, "int4") == 100
    assert kv_scale_bytes_per_token(model.config, "float16") == kv_scale_bytes_per_token(model.config, "fp8") == 0


def test_kvlab_memory_cli_shows_scales_as_metadata():
    import json
    import subprocess
    import sys

    run = [sys.executable, "-m", "kvlab", "memory", "--config", "kvlab/models/shakespeare", "--tokens", "256"]
    out = json.loads(subprocess.run(run + ["--dtype", "int8", "--json"], capture_output=True, text=True,
                                    check=True).stdout)
    assert out["bytes_per_token"] == 512 and out["scale_bytes_per_token"] == 64  # 36/128 of float32's 2048
    assert out["scale_bytes_per_token_by_dtype"]["float32"] == 0
    text = subprocess.run(run + ["--dtype", "int4-channel"], capture_output=True, text=True, check=True).stdout
    assert "scales" in text and "64 bytes per token" in text
