"""The contiguous cache's quantized store (kvlab/cache/quantized.py) on the block pool's codes: the NumPy
codec and the compiled writer store the same bytes in both, it grows as the float store does, and it reads
back in the compute dtype."""

from __future__ import annotations

import numpy as np
import pytest

from kvlab.cache.contiguous import ContiguousStore
from kvlab.cache.dtypes import resolve_kv_dtype
from kvlab.cache.quantized import QuantizedBlocks, QuantizedStore
from kvlab.errors import InputError

FORMATS = ["int8", "int4", "fp8_e4m3", "fp8_e5m2"]


def raw(array: np.ndarray) -> np.ndarray:
    """Bytes to compare (fp8 codes compare as their bit patterns)."""
    return np.ascontiguousarray(array).view(np.uint8)


@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_the_numpy_codec_and_the_compiled_writer_store_the_same_bytes(kv_dtype):
    fmt = resolve_kv_dtype(kv_dtype, np.float32)
    rng = np.random.default_rng(3)
    keys, values = (rng.standard_normal((2, 2, 7, 64)).astype(np.float32) for _ in range(2))
    compiled, plain = (QuantizedStore(1, 2, 2, 64, fmt, np.float32, capacity=16) for _ in range(2))
    assert all(codes.blocks.writer is not None for codes in (*compiled._keys, *compiled._values))
    for codes in (*plain._keys, *plain._values):
        codes.blocks.writer = None  # the NumPy codec (kvlab/cache/quant.py)
    for store in (compiled, plain):
        store.write(0, 3, keys, values)
    for mine, theirs in zip((*compiled._keys, *compiled._values), (*plain._keys, *plain._values)):
        assert all(np.array_equal(raw(a), raw(b)) for a, b in zip(mine.arrays(), theirs.arrays()))
    assert all(np.array_equal(a, b) for a, b in zip(compiled.read(0, 10), plain.read(0, 10)))
    pool, numpy_pool = (QuantizedBlocks(fmt, 4, 2, 8, 64, np.float32) for _ in range(2))
    numpy_pool.writer = None
    blocks, slots = np.array([3, 3, 1, 0, 2, 2, 1]), np.array([0, 7, 2, 5, 1, 6, 3])
    for p in (pool, numpy_pool):
        p.write(blocks, slots, keys[0].transpose(1, 0, 2))
    for a, b in ((pool.codes, numpy_pool.codes), (pool.scale, numpy_pool.scale), (pool.zero, numpy_pool.zero)):
        assert np.array_equal(raw(a), raw(b))
    # one block per batch row: the store's codes are the pool's layout, row b at [b, :, position]
    assert np.array_equal(raw(compiled._keys[0].blocks.codes[1, :, 3:10]),
                          raw(_one_block_pool(fmt, keys[1]).codes[0, :, :7]))


def _one_block_pool(fmt, rows: np.ndarray) -> QuantizedBlocks:
    pool = QuantizedBlocks(fmt, 1, 2, 7, 64, np.float32)
    pool.write(np.zeros(7, np.int64), np.arange(7), rows.transpose(1, 0, 2))
    return pool


@pytest.mark.parametrize("kv_dtype", ["int8", "int4-channel", "fp8_e5m2"])
def test_it_grows_as_the_float_store_does(kv_dtype):
    fmt = resolve_kv_dtype(kv_dtype, np.float32)
    for capacity in (0, 1, 16):
        stores = [QuantizedStore(2, 1, 2, 64, fmt, np.float32, capacity), ContiguousStore(2, 1, 2, 64, np.float32,
                                                                                        capacity)]
        grown = []
        for store in stores:
            sizes = [store.capacity_tokens]
            for wanted in (sizes[0], sizes[0] + 1, 40, 41, 200):  # exactly full keeps it; then doubling or more
                store.reserve(wanted)
                sizes.append(store.capacity_tokens)
            grown.append(sizes)
        if fmt.key_grouping == "channel":  # keys in whole 32-token blocks: at least what was asked
            assert all(q >= f for q, f in zip(*grown))
        else:
            assert grown[0] == grown[1]
    assert grown[1] == [16, 16, 32, 64, 64, 200]


@pytest.mark.parametrize("kv_dtype", FORMATS + ["int4-channel"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_reads_come_back_in_the_compute_dtype_after_a_fork(kv_dtype, dtype):
    store = QuantizedStore(2, 1, 2, 64, resolve_kv_dtype(kv_dtype, dtype), dtype, capacity=64)
    rows = np.random.default_rng(4).standard_normal((1, 2, 40, 64)).astype(dtype)
    store.write(1, 0, rows, rows)
    fork = store.copy(40)  # capacity 64 > the 40 rows copied
    for which in (store, fork):
        keys, values = which.read(1, 40)
        assert keys.dtype == values.dtype == dtype and keys.shape == (1, 2, 40, 64)
    assert all(np.array_equal(a, b) for a, b in zip(store.read(1, 40), fork.read(1, 40)))
    assert fork.nbytes(40) == store.nbytes(40) and fork.capacity_tokens >= 40


def test_a_block_pool_refuses_per_channel_keys_by_name():
    with pytest.raises(InputError) as caught:
        QuantizedBlocks(resolve_kv_dtype("int4-channel", np.float32), 4, 2, 16, 64, np.float32)
    assert str(caught.value) == ("the block pool stores int4 per token and head; per-channel key groups "
                                 "(int4-channel) are only available in the contiguous cache")
