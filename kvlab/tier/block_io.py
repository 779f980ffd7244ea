"""A pool block's K/V as a list of arrays, in a fixed order, and back: what the tier codec moves.

Per layer, keys then values; a float pool has one array per tensor ([H_kv, block_size, d]), a quantized
pool three (codes, scales, zeros: kvlab/cache/quantized.py), so scales travel with their codes. The
layout (dtype names and shapes of one layer's arrays, and the layer count) is what a stored block must
match exactly to be loaded here.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvlab.cache.quantized import QuantizedBlocks


def _tensor_arrays(layer: Any) -> list[np.ndarray]:
    """The backing arrays of one layer's keys or values, each indexed by block first."""
    if isinstance(layer, QuantizedBlocks):
        return [layer.codes, layer.scale, layer.zero]
    return [layer]


def _all_arrays(pool: Any) -> list[np.ndarray]:
    arrays: list[np.ndarray] = []
    for keys, values in zip(pool.key_cache, pool.value_cache):
        arrays += _tensor_arrays(keys) + _tensor_arrays(values)
    return arrays


def layout(pool: Any) -> dict[str, Any]:
    """What a block of this pool looks like, as JSON-able values (one layer's parts, and the layer count)."""
    per_layer = _tensor_arrays(pool.key_cache[0]) + _tensor_arrays(pool.value_cache[0])
    return {"num_layers": len(pool.key_cache),
            "parts": [{"dtype": a.dtype.name, "shape": list(a.shape[1:])} for a in per_layer]}


def part_dtypes(pool: Any) -> list[np.dtype]:
    """The dtypes of every array of a block, in order (the decoder builds arrays from these, never from
    the names a stored header carries)."""
    return [a.dtype for a in _all_arrays(pool)]


def read_block(pool: Any, block: int) -> list[np.ndarray]:
    """Copies of block `block`'s arrays (the pool may reuse the block as soon as this returns)."""
    return [np.ascontiguousarray(a[block]).copy() for a in _all_arrays(pool)]


def write_block(pool: Any, block: int, arrays: list[np.ndarray]) -> None:
    """Store `arrays` (as `read_block` returns them, layout already checked) into block `block`."""
    targets = _all_arrays(pool)
    if len(targets) != len(arrays):
        raise ValueError(f"a block of this pool has {len(targets)} arrays, got {len(arrays)}")
    for target, array in zip(targets, arrays):
        target[block] = array
