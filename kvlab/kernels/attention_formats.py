"""How a K/V store hands its rows to the decode-attention kernels: float rows, or codes with their scales.

numba-free on purpose: the cache layer names these when it describes its storage, and must import where
numba does not. A float store (float32/float16/bfloat16 rows [blocks, H_kv, rows, d]) is passed as the
array itself. A quantized store is passed as `StoredCodes`: the codes [blocks, H_kv, rows, d or d/2]
(uint8), float16 scale and zero per row and group [blocks, H_kv, rows, d/group] (empty for fp8), the
`kind` of code and the group size, so the kernel applies each scale as stored, row by row.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

FLOAT, INT8, INT4, FP8_E4M3, FP8_E5M2 = 0, 1, 2, 3, 4
KINDS = {"int8": INT8, "int4": INT4, "fp8_e4m3": FP8_E4M3, "fp8_e5m2": FP8_E5M2}


class StoredCodes(NamedTuple):
    """One layer's keys or values as a quantized store holds them (views, never copies)."""

    codes: np.ndarray  # uint8 [blocks, H_kv, rows, d] (int8, fp8) or [.., d/2] (int4, low nibble first)
    scale: np.ndarray  # float16 [blocks, H_kv, rows, d/group]; zero-sized for fp8
    zero: np.ndarray   # float16, as scale: a row's values are zero + code * scale, group by group
    kind: int          # INT8, INT4, FP8_E4M3 or FP8_E5M2
    group: int         # values per scale along d (int kinds)


def kind_of(name: str) -> int:
    """The kernels' code kind for a quantized cache format's base name (int8, int4, fp8_e4m3, fp8_e5m2)."""
    return KINDS[name.split("-")[0]]
