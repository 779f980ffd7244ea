"""QuantizedStore: a KVStore that keeps K/V as int8 / int4 codes with float16 scales, or as fp8.

Same contract as ContiguousStore (kvlab/cache/contiguous.py): rows [B, H_kv, n, d] are written at a
position and read back as the first `length` positions, but reads return *dequantized* copies in the
compute dtype, so the model attends over exactly what is stored (with per-token groups, what a token sees
does not depend on whether the rows were written by a prefill or by decode steps). Values are always grouped per token and
head; keys per token too, or per channel over blocks of `block_size` tokens (KIVI), in which case the
last, partial block is held in full precision until it fills.

`copy` clones codes and scales byte for byte (a fork never re-quantizes). A write before the end of the
stored rows (after a crop) simply overwrites token-grouped rows; for channel-grouped keys it reopens the
block it falls in: the block's earlier rows return to the full-precision tail as their dequantized values
and are quantized again, with fresh scales, when the block refills.

Token-grouped rows are kept by QuantizedBlocks, the block pool's storage (kvlab/cache/paged.py): a
contiguous cache of B sequences is a pool of B blocks, one per batch row, as long as its capacity. So the
codes, their layout, the writer and the decode kernels that read them in place are one implementation for
both runtimes.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import numpy as np

from kvlab.cache.contiguous import MIN_CAPACITY, grown_capacity
from kvlab.cache.quant import (FP8_DTYPES, SCALE_DTYPE, QuantFormat, decode_rows, dequantize_int,
                               encode_rows, pack_int4, quantize_int, unpack_int4)
from kvlab.errors import InputError
from kvlab.kernels import resolve_backend
from kvlab.kernels.attention_formats import StoredCodes, kind_of


def _codes_writer() -> Callable[[StoredCodes, np.ndarray, np.ndarray, np.ndarray], None] | None:
    """The compiled writer (kernels/attention_encode.py: the codec's arithmetic bit for bit, one call per
    write) where the compiled backend is in use; None: the NumPy codec."""
    if resolve_backend() != "numba":
        return None
    from kvlab.kernels.attention_encode import write_codes

    return write_codes


class _TokenCodes:
    """One tensor [B, H, T, d] stored per token: a QuantizedBlocks pool whose block b is batch row b, one
    block of `capacity` tokens each. The codec, the compiled writer and the codes' layout are the block
    pool's; what is contiguous is only growing and reading a prefix of every row."""

    def __init__(self, fmt: QuantFormat, shape: tuple[int, int, int], dtype: np.dtype, capacity: int) -> None:
        self.fmt, self.shape, self.dtype = replace(fmt, key_grouping="token"), shape, dtype
        batch, heads, dim = shape
        self.blocks = QuantizedBlocks(self.fmt, batch, heads, capacity, dim, dtype)
        self.batch_rows = np.arange(batch)

    @property
    def capacity(self) -> int:
        return self.blocks.shape[2]

    def stored(self) -> StoredCodes:
        """The codes and scales as the decode kernels read them in place (a batch row is a block)."""
        return self.blocks.stored()

    def arrays(self) -> tuple[np.ndarray, ...]:
        return self.blocks.codes, self.blocks.scale, self.blocks.zero

    def grow(self, capacity: int) -> None:
        self.blocks = self._copy_into(self.capacity, capacity).blocks

    def _copy_into(self, length: int, capacity: int) -> "_TokenCodes":
        clone = _TokenCodes(self.fmt, self.shape, self.dtype, capacity)
        for mine, theirs in zip(self.arrays(), clone.arrays()):
            theirs[:, :, :length] = mine[:, :, :length]
        return clone

    def write(self, start: int, x: np.ndarray) -> None:
        """Rows x [B, H, n, d] at positions start.. of every batch row (block)."""
        batch, heads, num, dim = x.shape
        self.blocks.write(np.repeat(self.batch_rows, num), np.tile(np.arange(start, start + num), batch),
                          x.transpose(0, 2, 1, 3).reshape(batch * num, heads, dim))

    def read(self, length: int) -> np.ndarray:
        codes, scale, zero = (a[:, :, :length] for a in self.arrays())
        return decode_rows(codes, scale, zero, self.fmt, self.blocks.group, self.dtype)

    def copy(self, length: int, capacity: int) -> "_TokenCodes":
        return self._copy_into(length, capacity)

    def nbytes(self, length: int) -> tuple[int, int]:
        """(payload, scale) bytes of the first `length` rows."""
        per_row = [a[:, :, :1].nbytes for a in self.arrays()]
        return per_row[0] * length, (per_row[1] + per_row[2]) * length


class _ChannelCodes:
    """Keys [B, H, T, d] stored per channel over blocks of `block_size` tokens (KIVI), tail in full precision."""

    def __init__(self, fmt: QuantFormat, shape: tuple[int, int, int], dtype: np.dtype, capacity: int) -> None:
        self.fmt, self.shape, self.dtype, self.block = fmt, shape, dtype, fmt.block_size
        batch, heads, dim = shape
        capacity = -(-capacity // self.block) * self.block
        self.codes = np.zeros((batch, heads, capacity, dim // 2 if fmt.bits == 4 else dim), np.uint8)
        self.scale = np.zeros((batch, heads, capacity // self.block, dim), SCALE_DTYPE)
        self.zero = np.zeros_like(self.scale)
        self.tail = np.zeros((batch, heads, self.block, dim), dtype)  # the partial block, full precision
        self.quantized = 0  # rows [0, quantized) are in codes: a multiple of block

    @property
    def capacity(self) -> int:
        return self.codes.shape[2]

    def arrays(self) -> tuple[np.ndarray, ...]:
        return self.codes, self.scale, self.zero, self.tail

    def grow(self, capacity: int) -> None:
        capacity = -(-capacity // self.block) * self.block
        for name, size in (("codes", capacity), ("scale", capacity // self.block), ("zero", capacity // self.block)):
            array = getattr(self, name)
            grown = np.zeros(array.shape[:2] + (size,) + array.shape[3:], array.dtype)
            grown[:, :, :array.shape[2]] = array
            setattr(self, name, grown)

    def _blocks(self, end: int) -> np.ndarray:
        """Dequantized rows [0, end) of the quantized part (end a multiple of block, <= quantized)."""
        batch, heads, dim = self.shape
        codes = self.codes[:, :, :end]
        if self.fmt.bits == 4:
            codes = unpack_int4(codes)
        n = end // self.block
        grouped = codes.reshape(batch, heads, n, self.block, dim)
        out = dequantize_int(grouped, self.scale[:, :, :n, None], self.zero[:, :, :n, None], self.dtype)
        return out.reshape(batch, heads, end, dim)

    def write(self, start: int, x: np.ndarray) -> None:
        if start < self.quantized:  # reopen the block `start` falls in
            first = start // self.block * self.block
            self.tail[:, :, :start - first] = self._blocks(first + self.block)[:, :, first:start]
            self.quantized = first
        position, i, num = start, 0, x.shape[2]
        while i < num:
            offset = position - self.quantized
            take = min(self.block - offset, num - i)
            self.tail[:, :, offset:offset + take] = x[:, :, i:i + take]
            position, i = position + take, i + take
            if position - self.quantized == self.block:
                codes, scale, zero = quantize_int(self.tail, self.fmt.bits, axis=-2)
                q, b = self.quantized, self.quantized // self.block
                self.codes[:, :, q:q + self.block] = pack_int4(codes) if self.fmt.bits == 4 else codes
                self.scale[:, :, b], self.zero[:, :, b] = scale[:, :, 0], zero[:, :, 0]
                self.quantized += self.block

    def read(self, length: int) -> np.ndarray:
        done = min(length, self.quantized)
        end = -(-done // self.block) * self.block
        head = self._blocks(end)[:, :, :done]
        if length <= done:
            return head
        return np.concatenate([head, self.tail[:, :, :length - done]], axis=2)

    def copy(self, length: int, capacity: int) -> "_ChannelCodes":
        """Byte-for-byte clone of every quantized block and the tail: rows past `length` are never read,
        and a later write there reopens its block exactly as it would in the original."""
        clone = _ChannelCodes(self.fmt, self.shape, self.dtype, max(capacity, self.quantized))
        done, blocks = self.quantized, self.quantized // self.block
        clone.codes[:, :, :done] = self.codes[:, :, :done]
        clone.scale[:, :, :blocks], clone.zero[:, :, :blocks] = self.scale[:, :, :blocks], self.zero[:, :, :blocks]
        clone.tail[...] = self.tail
        clone.quantized = done
        return clone

    def nbytes(self, length: int) -> tuple[int, int]:
        done = min(length, self.quantized)
        per_code_row = self.codes[:, :, :1].nbytes
        blocks = -(-done // self.block)
        return (per_code_row * done + self.tail[:, :, :1].nbytes * (length - done),
                (self.scale[:, :, :1].nbytes + self.zero[:, :, :1].nbytes) * blocks)


class QuantizedStore:
    """KVStore in a QuantFormat; reads dequantize to `dtype` (the model's compute dtype)."""

    def __init__(self, num_layers: int, batch_size: int, num_kv_heads: int, head_dim: int, fmt: QuantFormat,
                 dtype: np.dtype, capacity: int = MIN_CAPACITY) -> None:
        self.fmt, self.dtype = fmt, np.dtype(dtype)
        self.shape = (batch_size, num_kv_heads, head_dim)
        capacity = max(int(capacity), 1)
        key_kind = _ChannelCodes if fmt.key_grouping == "channel" and not fmt.is_float else _TokenCodes
        self._keys = [key_kind(fmt, self.shape, self.dtype, capacity) for _ in range(num_layers)]
        self._values = [_TokenCodes(fmt, self.shape, self.dtype, capacity) for _ in range(num_layers)]

    @property
    def capacity_tokens(self) -> int:
        return min(self._keys[0].capacity, self._values[0].capacity)

    @property
    def capacity_bytes(self) -> int:
        return sum(a.nbytes for codes in (*self._keys, *self._values) for a in codes.arrays())

    def reserve(self, num_tokens: int) -> None:
        capacity = self.capacity_tokens
        if num_tokens <= capacity:
            return
        new_capacity = grown_capacity(capacity, num_tokens)
        for codes in (*self._keys, *self._values):
            codes.grow(new_capacity)

    def write(self, layer: int, start: int, keys: np.ndarray, values: np.ndarray) -> None:
        self._keys[layer].write(start, keys)
        self._values[layer].write(start, values)

    def read(self, layer: int, length: int) -> tuple[np.ndarray, np.ndarray]:
        return self._keys[layer].read(length), self._values[layer].read(length)

    @property
    def in_place(self) -> bool:
        """Whether the decode kernels may read the codes where they lie (`storage`): keys grouped per token."""
        return all(isinstance(k, _TokenCodes) for k in self._keys)

    def storage(self, layer: int) -> tuple[StoredCodes, StoredCodes]:
        """The layer's codes and scales [B, H_kv, capacity, ..] for the kernels (only when `in_place`)."""
        return self._keys[layer].stored(), self._values[layer].stored()

    def copy(self, length: int) -> "QuantizedStore":
        clone = QuantizedStore(0, *self.shape, self.fmt, self.dtype)
        capacity = max(length, MIN_CAPACITY)
        clone._keys = [k.copy(length, capacity) for k in self._keys]
        clone._values = [v.copy(length, capacity) for v in self._values]
        return clone

    def nbytes(self, length: int) -> tuple[int, int]:
        """(payload, scale) bytes of the first `length` positions of every layer."""
        payload = scales = 0
        for codes in (*self._keys, *self._values):
            p, s = codes.nbytes(length)
            payload, scales = payload + p, scales + s
        return payload, scales


class QuantizedBlocks:
    """One layer's keys or values in a block pool (kvlab/cache/paged.py), per token and head in a QuantFormat.

    Codes [num_blocks, H_kv, block_size, d or d/2] plus float16 scale and zero per token, head and group,
    so a block is self-contained: sharing, copy-on-write and prefix hits move whole rows with their scales.
    Per-channel key grouping would tie a block's scales to every token in it and is refused here.
    `shape` is the logical [num_blocks, H_kv, block_size, d]; reads dequantize to `dtype`.
    """

    def __init__(self, fmt: QuantFormat, num_blocks: int, num_kv_heads: int, block_size: int, head_dim: int,
                 dtype: np.dtype) -> None:
        if fmt.key_grouping == "channel" and not fmt.is_float:
            raise InputError(f"the block pool stores {fmt.name.split('-')[0]} per token and head; per-channel "
                             f"key groups ({fmt.name}) are only available in the contiguous cache")
        self.fmt, self.dtype = fmt, np.dtype(dtype)
        self.shape = (num_blocks, num_kv_heads, block_size, head_dim)
        self.group = fmt.group(head_dim)
        codes_dtype = FP8_DTYPES[fmt.name] if fmt.is_float else np.dtype(np.uint8)
        self.codes = np.zeros(self.shape[:3] + (head_dim // 2 if fmt.bits == 4 else head_dim,), codes_dtype)
        groups = 0 if fmt.is_float else head_dim // self.group
        self.scale = np.zeros(self.shape[:3] + (groups,), SCALE_DTYPE)
        self.zero = np.zeros_like(self.scale)
        self.writer = _codes_writer()

    def stored(self) -> StoredCodes:
        """The codes and scales as the decode kernels read them in place."""
        return StoredCodes(self.codes, self.scale, self.zero, kind_of(self.fmt.name), self.group)

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scale.nbytes + self.zero.nbytes

    def write(self, blocks: np.ndarray, rows: np.ndarray, x: np.ndarray) -> None:
        """Store rows x [N, H_kv, d] at (blocks[i], rows[i])."""
        if self.writer is not None:
            self.writer(self.stored(), blocks, rows, x)
            return
        codes, scale, zero = encode_rows(x, self.fmt, self.group)
        self.codes[blocks, :, rows] = codes
        if scale is not None:
            self.scale[blocks, :, rows], self.zero[blocks, :, rows] = scale, zero

    def gather(self, block_tables: np.ndarray, length: int) -> np.ndarray:
        """The first `length` positions of each row's blocks, dequantized: [B, H_kv, length, d]."""
        def take(array: np.ndarray) -> np.ndarray:
            picked = array[block_tables]  # [B, M, H, block_size, k]
            b, m, h, size, k = picked.shape
            return picked.transpose(0, 2, 1, 3, 4).reshape(b, h, m * size, k)[:, :, :length]

        return decode_rows(take(self.codes), take(self.scale), take(self.zero), self.fmt, self.group,
                           self.dtype)

    def copy_rows(self, src: int, dst: int, num_tokens: int) -> None:
        for array in (self.codes, self.scale, self.zero):
            array[dst, :, :num_tokens] = array[src, :, :num_tokens]
