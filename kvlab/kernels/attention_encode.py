"""Cache writes for the attention kernels: new K/V rows quantized to int8 / int4 / fp8 codes, compiled.

A decode step writes one row per KV head and layer. In NumPy the codec (kvlab/cache/quant.py) is ~20 array
calls per write, microseconds each, which cost a few milliseconds a step on SmolLM2-135M's shape; here a
write is one call. The arithmetic is the codec's own, bit for bit (tests/test_kernels_quant.py holds the
codes, scales and zeros to `encode_rows`): per group, zero = its minimum rounded down to float16, scale =
(max - zero) / levels rounded up to float16, codes = rint((x - zero) / scale) in float64; fp8 = the value
clipped to the format's largest finite one and rounded to nearest even. No fastmath here: the rounding is
the contract.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from kvlab.kernels.attention_formats import FP8_E4M3, FP8_E5M2, INT8, StoredCodes

_F16_MAX = 65504.0
_F16_MIN_NORMAL = 2.0 ** -14
_F16_SUBNORMAL = 2.0 ** -24


@njit(fastmath=False, cache=True)
def _negative(x):
    return x < 0 or (x == 0 and math.copysign(1.0, x) < 0)


@njit(fastmath=False, cache=True)
def f16_round(x, up):
    """The float16 value next to x in direction up (+inf) or down (-inf), as a float64: the largest float16
    <= x, or the smallest >= x (x itself when representable); past float16's range, inf or its max."""
    neg = _negative(x)
    a = abs(x)
    away = up != neg  # rounding up a positive value (or down a negative one) moves its magnitude away from 0
    if a < _F16_MIN_NORMAL:
        ulp = _F16_SUBNORMAL
    else:
        ulp = math.ldexp(1.0, math.frexp(a)[1] - 11)
    k = a / ulp
    t = math.floor(k)
    if away and t != k:
        t += 1.0
    r = t * ulp
    if r > _F16_MAX:
        r = math.inf if away else _F16_MAX
    return -r if neg else r


@njit(fastmath=False, cache=True)
def f16_bits(v):
    """The float16 bit pattern (uint16) of a float64 that float16 represents exactly (or +-inf)."""
    sign = 0x8000 if _negative(v) else 0
    a = abs(v)
    if a == math.inf:
        return np.uint16(sign | 0x7C00)
    if a < _F16_MIN_NORMAL:  # zero and subnormals: a multiple of 2^-24
        return np.uint16(sign | int(a / _F16_SUBNORMAL))
    m, e = math.frexp(a)  # a = m 2^e, m in [0.5, 1)
    return np.uint16(sign | ((e - 1 + 15) << 10) | int((2.0 * m - 1.0) * 1024.0))


@njit(fastmath=False, cache=True)
def fp8_bits(x, mantissa, bias, largest):
    """fp8 code (uint8) of x: clipped to +-largest, rounded to nearest even (subnormals included)."""
    v = min(max(float(x), -largest), largest)
    sign = 0x80 if _negative(v) else 0
    a = abs(v)
    if a < math.ldexp(1.0, 1 - bias):  # subnormal steps of 2^(1 - bias - mantissa); rounding up to the
        return np.uint8(sign | int(np.rint(a / math.ldexp(1.0, 1 - bias - mantissa))))  # first normal is its code
    exponent = math.frexp(a)[1] - 1  # a in [2^exponent, 2^(exponent + 1))
    steps = np.rint(a / math.ldexp(1.0, exponent - mantissa))  # in [2^mantissa, 2^(mantissa + 1)]
    if steps == 2 ** (mantissa + 1):
        exponent, steps = exponent + 1, 2.0 ** mantissa
    return np.uint8(sign | ((exponent + bias) << mantissa) | (int(steps) - (1 << mantissa)))


@njit(fastmath=False, cache=True)
def encode_into(x, codes, scale, zero, blocks, rows, kind, group):
    """Row n of x [N, H_kv, d] (float32/float64), head h, into codes[blocks[n], h, rows[n]] (uint8, d or
    d/2 wide) and, for int kinds, its float16 scale and zero bits per group into scale/zero [.., d/group]
    (uint16 views)."""
    num, heads, d = x.shape
    levels = 255.0 if kind == INT8 else 15.0
    for n in range(num):
        b, r = blocks[n], rows[n]
        for h in range(heads):
            src, dst = x[n, h], codes[b, h, r]
            if kind == FP8_E4M3:
                for i in range(d):
                    dst[i] = fp8_bits(src[i], 3, 7, 448.0)
                continue
            if kind == FP8_E5M2:
                for i in range(d):
                    dst[i] = fp8_bits(src[i], 2, 15, 57344.0)
                continue
            for j in range(d // group):
                base = j * group
                lo = hi = float(src[base])
                for i in range(base, base + group):
                    lo, hi = min(lo, float(src[i])), max(hi, float(src[i]))
                z = f16_round(lo + 0.0, False)  # a least value of -0.0 gives the zero point +0, as quant.py
                s = f16_round((hi - z) / levels, True)
                scale[b, h, r, j], zero[b, h, r, j] = f16_bits(s), f16_bits(z)
                safe = s if s > 0 else 1.0
                for i in range(group):
                    c = np.uint8(min(max(np.rint((float(src[base + i]) - z) / safe), 0.0), levels))
                    if kind == INT8:
                        dst[base + i] = c
                    elif i % 2 == 0:
                        dst[(base + i) // 2] = c
                    else:
                        dst[(base + i) // 2] |= np.uint8(c << np.uint8(4))


def write_codes(stored: StoredCodes, blocks: np.ndarray, rows: np.ndarray, x: np.ndarray) -> None:
    """Quantize rows x [N, H_kv, d] into `stored` at (blocks[n], rows[n]): what `encode_rows` and an
    assignment do, in one compiled call."""
    if x.dtype not in (np.float32, np.float64):  # float16/bfloat16 rows: exact in float64, as the codec reads them
        x = x.astype(np.float64)
    encode_into(np.ascontiguousarray(x), stored.codes.view(np.uint8), stored.scale.view(np.uint16),
                stored.zero.view(np.uint16), np.asarray(blocks, dtype=np.int64), np.asarray(rows, dtype=np.int64),
                stored.kind, stored.group)
