"""Cache dtypes: every name a user may type for how K/V rows are stored, and the bytes each scalar costs.

Why one place: the API (`kv_cache_dtype=`), the CLI flags, `kvlab memory`, the engine's pool sizing, session
files and policy specs all read the same names; a spelling one of them accepts must mean the same storage
everywhere, and the bytes `kvlab memory` prints must be the bytes the caches allocate. A name resolves to a
NumPy dtype (float caches) or a QuantFormat (int8/int4 with float16 scales, fp8; kvlab/cache/quant.py).
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np

from kvlab.cache.quant import DEFAULT_KEY_GROUPING, FP8_DTYPES, QuantFormat
from kvlab.errors import InputError

try:  # bfloat16 storage for caches; optional at import time, required to use it
    import ml_dtypes
    _BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover
    _BFLOAT16 = None

FLOAT_NAMES = ("float64", "float32", "float16", "bfloat16")
ALIASES = {"fp64": "float64", "fp32": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16",
           "fp8": "fp8_e4m3", "float8": "fp8_e4m3", "float8_e4m3": "fp8_e4m3", "float8_e4m3fn": "fp8_e4m3",
           "fp8_e4m3fn": "fp8_e4m3", "float8_e5m2": "fp8_e5m2", "q8": "int8", "q4": "int4"}
# The names `kv_cache_dtype` accepts beyond float dtypes. "-token"/"-channel" pick how keys are grouped.
QUANT_NAMES = ("int8", "int4", "fp8", "fp8_e4m3", "fp8_e5m2", "int8-token", "int8-channel", "int4-token",
               "int4-channel")
# Every `kv_cache_dtype` name the API and CLI flags accept (plus dtype objects and the aliases above).
KV_CACHE_DTYPES = ("float32", "float16", "bfloat16", "float64", "fp32", "fp16", "bf16", "fp64") + QUANT_NAMES

# Storage kinds as memory is sized: both fp8 layouts cost one byte, both key groupings the same codes.
# Bytes of payload per stored scalar; int8/int4 scales are extra (scale_bytes_per_row).
PAYLOAD_BYTES: dict[str, Fraction] = {"float64": Fraction(8), "float32": Fraction(4), "float16": Fraction(2),
                                      "bfloat16": Fraction(2), "fp8": Fraction(1), "int8": Fraction(1),
                                      "int4": Fraction(1, 2)}


def _name(dtype: object) -> str:
    return str(getattr(dtype, "__name__", getattr(dtype, "name", dtype))).lower()


def parse_quant_format(name: str) -> QuantFormat | None:
    """QuantFormat for a quantized cache-dtype name, or None if `name` is not one (a float dtype, say)."""
    key = ALIASES.get(name, name)
    base, _, grouping = key.partition("-")
    if base in FP8_DTYPES and not grouping:
        return QuantFormat(base, 8)
    if base not in ("int8", "int4"):
        return None
    if grouping not in ("", "token", "channel"):
        raise InputError(f"unknown key grouping {grouping!r} in cache dtype {name!r}: use {base}, "
                         f"{base}-token or {base}-channel")
    return QuantFormat(key, 8 if base == "int8" else 4, grouping or DEFAULT_KEY_GROUPING)


def resolve_kv_dtype(kv_dtype: object, compute_dtype: np.dtype) -> np.dtype | QuantFormat:
    """Map a name ("float16", "bf16", "int8", "fp8_e5m2", ...) or dtype to how cached rows are stored:
    a NumPy dtype for float caches, a QuantFormat for quantized ones (kvlab/cache/quant.py). None: the
    compute dtype (what kvlab allocates when nobody asks for less)."""
    if kv_dtype is None:
        return np.dtype(compute_dtype)
    if isinstance(kv_dtype, QuantFormat):
        return kv_dtype
    name = ALIASES.get(_name(kv_dtype), _name(kv_dtype))
    if name == "bfloat16" and _BFLOAT16 is not None:
        return _BFLOAT16
    if name in ("float64", "float32", "float16"):
        return np.dtype(name)
    quantized = parse_quant_format(name.replace("_", "-") if name.startswith("int") else name)
    if quantized is not None:
        return quantized
    raise InputError(f"unsupported KV cache dtype {kv_dtype!r}: choose float64, float32, float16, bfloat16, "
                     "int8, int4, fp8_e4m3 or fp8_e5m2")


def size_name(dtype: object) -> str:
    """The storage kind a dtype (name, NumPy dtype or QuantFormat) is sized as: a key of PAYLOAD_BYTES."""
    name = ALIASES.get(_name(dtype), _name(dtype))
    if name in FLOAT_NAMES:
        return name
    fmt = parse_quant_format(name.replace("_", "-") if name.startswith("int") else name)
    if fmt is None:
        raise InputError(f"unknown cache dtype {dtype!r}; choose from {', '.join(PAYLOAD_BYTES)}")
    return "fp8" if fmt.is_float else f"int{fmt.bits}"


def scale_group(head_dim: int, group_size: int = 32) -> int:
    """Values per int8/int4 scale along head_dim: `group_size`, or the whole head when it does not divide."""
    return group_size if head_dim % group_size == 0 else head_dim


def scale_bytes_per_row(dtype: object, head_dim: int) -> int:
    """Metadata bytes one stored row (one token, one head, K or V) adds: int8/int4 keep a float16 scale and
    zero per group (as kvlab/cache/quantized.py stores them); float dtypes and fp8 (a plain cast) none."""
    if size_name(dtype) not in ("int8", "int4"):
        return 0
    return (head_dim // scale_group(head_dim)) * 2 * 2
