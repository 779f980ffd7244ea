"""Every spelling of a KV cache dtype resolves to the storage it names (mutation testing found the aliases
unasserted), and anything else is refused with the choices listed."""

import ml_dtypes
import numpy as np
import pytest

from kvlab.cache.dtypes import KV_CACHE_DTYPES, resolve_kv_dtype
from kvlab.cache.quant import QuantFormat
from kvlab.errors import InputError

FLOATS = {
    "float64": np.float64, "fp64": np.float64, "FP64": np.float64, np.float64: np.float64,
    "float32": np.float32, "fp32": np.float32, np.float32: np.float32,
    "float16": np.float16, "fp16": np.float16, "half": np.float16, "Float16": np.float16,
    np.float16: np.float16, "bfloat16": ml_dtypes.bfloat16, "bf16": ml_dtypes.bfloat16,
    "BF16": ml_dtypes.bfloat16, ml_dtypes.bfloat16: ml_dtypes.bfloat16,
}


@pytest.mark.parametrize("name,want", list(FLOATS.items()), ids=str)
def test_float_spellings(name, want):
    got = resolve_kv_dtype(name, np.float32)
    assert isinstance(got, np.dtype) and got == np.dtype(want)


@pytest.mark.parametrize("compute", [np.float32, np.float64])
def test_none_is_the_compute_dtype(compute):
    assert resolve_kv_dtype(None, compute) == np.dtype(compute)


@pytest.mark.parametrize("name,bits,grouping", [
    ("int8", 8, "token"), ("INT8", 8, "token"), ("int8-token", 8, "token"), ("int8_channel", 8, "channel"),
    ("int8-channel", 8, "channel"), ("int4", 4, "token"), ("int4-channel", 4, "channel"),
    ("int4_token", 4, "token")])
def test_integer_formats(name, bits, grouping):
    got = resolve_kv_dtype(name, np.float32)
    assert isinstance(got, QuantFormat) and (got.bits, got.key_grouping, got.is_float) == (bits, grouping, False)
    assert resolve_kv_dtype(got, np.float64) is got  # a format passes through unchanged


@pytest.mark.parametrize("name,want", [("fp8_e4m3", "fp8_e4m3"), ("fp8_e5m2", "fp8_e5m2"), ("FP8_E5M2", "fp8_e5m2")])
def test_fp8_formats(name, want):
    got = resolve_kv_dtype(name, np.float32)
    assert isinstance(got, QuantFormat) and got.bits == 8 and got.is_float and got.name == want


@pytest.mark.parametrize("name", ["fp8", "float8"])
def test_fp8_alone_is_e4m3(name):
    assert resolve_kv_dtype(name, np.float32).name == "fp8_e4m3"


def test_every_listed_cli_choice_resolves():
    for name in KV_CACHE_DTYPES:
        resolve_kv_dtype(name, np.float32)


@pytest.mark.parametrize("bad", ["float7", "int2", "fp4", "float", "", "int8-row", np.int32, 3])
def test_other_names_are_refused_with_the_choices(bad):
    with pytest.raises(InputError) as info:
        resolve_kv_dtype(bad, np.float32)
    message = str(info.value)
    assert repr(bad) in message or "grouping" in message
    if "grouping" not in message:
        assert "float64, float32, float16, bfloat16, int8, int4, fp8_e4m3 or fp8_e5m2" in message
