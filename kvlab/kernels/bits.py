"""Half-precision storage as raw bits, widened to float32 in registers.

numba has no float16 or bfloat16 type, so kernels see half-precision arrays as 16-bit integers and widen
each element where it is used: bfloat16 as uint16 (its bits are float32's top half: shift left 16) and
float16 as int16 (bits moved into float32's layout, then scaled by 2^112, which is exact for normal and
subnormal values alike). The integer type tells the kernel which format it holds, so one kernel source
serves float32/float64, float16 and bfloat16 arrays, compiled once per dtype.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
from numba import types
from numba.extending import overload

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
_F16_SCALE = np.float32(2.0 ** 112)


def as_kernel_array(array: np.ndarray) -> np.ndarray:
    """The view a kernel takes: bfloat16 -> uint16 bits, float16 -> int16 bits, other floats unchanged."""
    if array.dtype == BFLOAT16:
        return array.view(np.uint16)
    if array.dtype == np.float16:
        return array.view(np.int16)
    return array


def widen(value):  # pragma: no cover - the Python body is never run; numba uses the overload below
    """float32 (or float64) value of one stored element."""
    raise NotImplementedError


@overload(widen, inline="always")
def _widen_overload(value):
    if value == types.uint16:  # bfloat16 bits
        def widen_bf16(value):
            return np.uint32(np.uint32(value) << np.uint32(16)).view(np.float32)
        return widen_bf16
    if value == types.int16:  # float16 bits (finite values; the loader refuses inf/nan weights)
        def widen_f16(value):
            bits = np.uint32(np.uint16(value))
            moved = np.uint32(((bits & np.uint32(0x7FFF)) << np.uint32(13))
                              | ((bits & np.uint32(0x8000)) << np.uint32(16)))
            return moved.view(np.float32) * _F16_SCALE
        return widen_f16
    if isinstance(value, types.Float):
        return lambda value: value
    return None
