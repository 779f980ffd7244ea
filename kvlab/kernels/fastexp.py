"""exp that LLVM can vectorise, for the softmax and SiLU inside compiled kernels.

numba lowers `np.exp` on a scalar to a call into libm (no SVML here): one element at a time, ~15
cycles each. A prefill of 1024 tokens on SmolLM2-135M's shape takes ~140 M exponentials in attention
and ~47 M in SwiGLU, so the call alone would cost a large share of the step. This is Cephes' expf
(range reduction by ln 2 in two parts, a degree-5 polynomial, the exponent built from bits): branch-free,
so the loop around it vectorises, and within 2 ulp of float32's exp over its whole range. Inputs past
float32's range saturate: above 88.37 it returns inf, below -87.34 zero (subnormals flushed).

A float64 kernel keeps `np.exp` (float64 models are the exact reference; speed is not their point).
"""

from __future__ import annotations

import numpy as np
from numba import types
from numba.extending import overload

_LOG2E = np.float32(1.44269504088896341)
_LN2_HI = np.float32(0.693359375)  # ln 2 split so that n * _LN2_HI is exact for |n| < 2^9
_LN2_LO = np.float32(-2.12194440e-4)
_P0, _P1, _P2 = np.float32(1.9875691500e-4), np.float32(1.3981999507e-3), np.float32(8.3334519073e-3)
_P3, _P4, _P5 = np.float32(4.1665795894e-2), np.float32(1.6666665459e-1), np.float32(5.0000001201e-1)
# Past _HIGH the exponent 2^n would overflow (n = 128); exp there is within 1.5x of float32's largest
# value, so inf is as good an answer for softmax and SiLU. Below _LOW the result would be subnormal.
_HIGH, _LOW = np.float32(88.37), np.float32(-87.33654022216797)
_ONE, _HALF = np.float32(1.0), np.float32(0.5)


def fast_exp(x):  # pragma: no cover - the Python body is never run; numba uses the overload below
    """e**x for a float32 (vectorisable) or float64 (np.exp) scalar inside a compiled kernel."""
    raise NotImplementedError


@overload(fast_exp, inline="always")
def _fast_exp_overload(x):
    if x == types.float32:
        def exp32(x):
            clipped = min(max(x, _LOW), _HIGH)
            n = np.floor(clipped * _LOG2E + _HALF)
            r = clipped - n * _LN2_HI - n * _LN2_LO
            p = ((((_P0 * r + _P1) * r + _P2) * r + _P3) * r + _P4) * r + _P5
            y = p * r * r + r + _ONE
            # Saturation without branches: past _HIGH the exponent field is set to all ones (2^n = inf),
            # below _LOW the result is multiplied by 0. A value reassigned in `if` branches made numba's IR
            # check warn ("variable ... is not in scope", "please report") on every cold compile.
            high = np.int32(x > _HIGH)
            exponent = (np.int32(n) + np.int32(127)) | (high * np.int32(255))
            scale = np.uint32(exponent << np.int32(23)).view(np.float32)
            return y * scale * np.float32(not x < _LOW)
        return exp32
    if isinstance(x, types.Float):
        return lambda x: np.exp(x)
    return None
