"""GGUF's quantized blocks as codes, scales and offsets: the one layout the quantized kernels read.

Every ggml block type kvlab runs stores, per group of 16 or 32 consecutive weights of a row, small integer
codes and a float scale (and, for the "_1" and K types, an offset): weight = scale * code + offset. The
types differ only in how the codes and scales are packed into bytes. `unpack` undoes the packing once at
load, into:

* codes: 4-bit types (Q4_0, Q4_1, Q4_K) as nibbles, two per byte, [N, K/2] uint8, byte j of a group of
  32 holding weight j (low nibble) and weight j + 16 (high); every other type as int8 codes [N, K];
* scales and offsets: one per group, [N, K/group] float32 (the stored float16 scale widened, or for K
  types the product d * sub-block scale, exact in float32). float16 scales would save 2 bytes a group,
  but widening one per group in the kernel made products 1.5-1.8x slower (one-off measurement under load,
  Q8_0 and Q4_0, 8192 x 4096).

`scale * code + offset` in float32 is bit-identical to `gguf.quants.dequantize` for every type (tests hold
it), so a kernel that reads these arrays computes with exactly the weights of the file. What it costs in
resident bytes per weight, against the file's (offset-free types keep no offsets):

  Q8_0 1.125 (file 1.0625) · Q4_0 0.75 (0.5625; 0.625 as QuantizedMatrix tiles keep it: its offsets are
  folded, model/quantized.py) · Q4_1 0.75 (0.625) · Q5_0 1.125 (0.6875) ·
  Q5_1 1.25 (0.75) · Q4_K 0.75 (0.5625) · Q5_K 1.25 (0.6875) · Q6_K 1.25 (0.8203) · Q3_K 1.25 (0.4297) ·
  Q2_K 1.5 (0.3281)

5-, 6-, 3- and 2-bit codes are widened to a byte each here: simpler code, more bytes than the file. The
model's tiles (model/quantized.py) pack 5- and 6-bit codes again in both layouts, a nibble and a bit or a
crumb (model/qtiles.to_packed_codes): Q5_0 0.75 bytes a weight with float32 scales (the exact mode), 0.6875
with the integer kernels' float16 ones (activations="q8", the default for block types): the file's; Q6_K
0.8281 in both (a factored scale an int8 a group): 1.01x the file's. 3- and 2-bit codes stay a byte.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

QK_K = 256
NIBBLE_TYPES = ("Q4_0", "Q4_1", "Q4_K")
BLOCK_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
# (weights per block, bytes per block), as ggml defines them
BLOCK_SIZES = {"Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24),
               "Q2_K": (256, 84), "Q3_K": (256, 110), "Q4_K": (256, 144), "Q5_K": (256, 176),
               "Q6_K": (256, 210)}


# weights per scale (and offset), and the types that keep an offset (Q4_0's zero point -8 d becomes one)
GROUPS = {"Q8_0": 32, "Q4_0": 32, "Q4_1": 32, "Q5_0": 32, "Q5_1": 32, "Q2_K": 16, "Q3_K": 16, "Q4_K": 32,
          "Q5_K": 32, "Q6_K": 16}
OFFSET_TYPES = ("Q4_0", "Q4_1", "Q5_1", "Q2_K", "Q4_K", "Q5_K")


def resident_bytes(type_name: str, shape: tuple[int, int]) -> int:
    """Bytes a [N, K] matrix of `type_name` takes unpacked (codes + float32 scales and offsets), without
    reading it: what `kvlab memory --model` reports for weights kept as stored."""
    rows, cols = shape
    code_bytes = cols // 2 if type_name in NIBBLE_TYPES else cols
    per_group = 4 * (2 if type_name in OFFSET_TYPES else 1)
    return rows * (code_bytes + cols // GROUPS[type_name] * per_group)


@dataclass(frozen=True)
class Unpacked:
    """codes [N, K] int8 or [N, K/2] uint8 nibbles; scales/offsets [N, K/group]; offsets None if zero, or
    when `offset_scale` is set, `offset_scale * scales` (Q4_0's -8 * scale, exact: kept only as the factor
    by the quantized matrices' tiles, so a Q4_0 model holds no offsets array). A K type's tiles may keep
    their scales (and offsets) factored: int8 a group with `base_scales` (`base_offsets`) float32 a
    super-block and row, the same float32 values (model/qtiles.factor_scales)."""

    codes: np.ndarray
    scales: np.ndarray
    offsets: np.ndarray | None
    group: int
    offset_scale: float | None = None
    base_scales: np.ndarray | None = None
    base_offsets: np.ndarray | None = None

    @property
    def nibbles(self) -> bool:
        return self.codes.dtype == np.uint8


def _f16(raw: np.ndarray) -> np.ndarray:
    """Little-endian float16 fields [..., 2] (bytes) as float16 [...]."""
    return np.ascontiguousarray(raw).view("<f2")[..., 0]


def _nibbles_of_32(low: np.ndarray, high: np.ndarray) -> np.ndarray:
    """Codes 0..15 of groups of 32 ([G, 32] uint8, low = weights 0..15, high = 16..31) packed as bytes."""
    return (low | (high << np.uint8(4))).astype(np.uint8)


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes of 6-bit scales and mins for 8 sub-blocks -> ([B, 8], [B, 8]) uint8."""
    s = scales.reshape(-1, 3, 4)
    d, m, m_d = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mins = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mins


def unpack(type_name: str, raw: np.ndarray, shape: tuple[int, int]) -> Unpacked:
    """The blocks of a [N, K] tensor (`raw`: its bytes, any shape) as codes, scales and offsets."""
    if type_name not in BLOCK_SIZES:
        raise ValueError(f"no block layout for {type_name}; block types: {', '.join(BLOCK_TYPES)}")
    rows, cols = shape
    block, size = BLOCK_SIZES[type_name]
    if cols % block:
        raise ValueError(f"{type_name} rows hold whole blocks of {block} weights; a row of {cols} does not")
    b = np.asarray(raw, dtype=np.uint8).reshape(-1, size)
    if b.shape[0] != rows * cols // block:
        raise ValueError(f"{type_name} tensor of shape {shape} needs {rows * cols // block} blocks, "
                         f"got {b.shape[0]}")
    unpacked = _UNPACK[type_name](b)
    groups = cols // unpacked.group
    codes = unpacked.codes.reshape(rows, -1)
    scales = unpacked.scales.astype(np.float32).reshape(rows, groups)
    offsets = None if unpacked.offsets is None else unpacked.offsets.astype(np.float32).reshape(rows, groups)
    return Unpacked(np.ascontiguousarray(codes), np.ascontiguousarray(scales),
                    None if offsets is None else np.ascontiguousarray(offsets), unpacked.group)


def _q8_0(b: np.ndarray) -> Unpacked:
    return Unpacked(b[:, 2:].view(np.int8), _f16(b[:, :2]), None, 32)


def _q4_0(b: np.ndarray) -> Unpacked:
    d = _f16(b[:, :2]).astype(np.float32)
    # weight = d * (q - 8) = d * q + (-8 d): both terms exact (q and 8 are small), so the sum is too (only the
    # sign of a zero may differ)
    return Unpacked(b[:, 2:].copy(), d, d * np.float32(-8), 32)


def _q4_1(b: np.ndarray) -> Unpacked:
    return Unpacked(b[:, 4:].copy(), _f16(b[:, :2]), _f16(b[:, 2:4]), 32)


def _q5_low_high(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1's 5-bit codes 0..31 [B, 32] from 4 bytes of high bits and 16 bytes of nibbles."""
    high = (np.ascontiguousarray(qh).view("<u4") >> np.arange(32, dtype=np.uint32)) & np.uint32(1)
    low = np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=-1)
    return low | (high.astype(np.uint8) << np.uint8(4))


def _q5_0(b: np.ndarray) -> Unpacked:
    q = _q5_low_high(b[:, 2:6], b[:, 6:])
    return Unpacked((q.astype(np.int16) - 16).astype(np.int8), _f16(b[:, :2]), None, 32)


def _q5_1(b: np.ndarray) -> Unpacked:
    q = _q5_low_high(b[:, 4:8], b[:, 8:])
    return Unpacked(q.astype(np.int8), _f16(b[:, :2]), _f16(b[:, 2:4]), 32)


def _q2_k(b: np.ndarray) -> Unpacked:
    n = b.shape[0]
    scales, qs = b[:, :16], b[:, 16:80]
    d, dmin = _f16(b[:, 80:82]).astype(np.float32), _f16(b[:, 82:84]).astype(np.float32)
    dl = d[:, None] * (scales & 0xF).astype(np.float32)
    ml = dmin[:, None] * (scales >> 4).astype(np.float32)
    q = (qs.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & np.uint8(3)
    return Unpacked(q.reshape(n, QK_K).astype(np.int8), dl, -ml, 16)


def _q3_k(b: np.ndarray) -> Unpacked:
    n = b.shape[0]
    hmask, qs, scales = b[:, :32], b[:, 32:96], b[:, 96:108]
    d = _f16(b[:, 108:110]).astype(np.float32)
    low = (scales[:, :8].reshape(n, 1, 8) >> np.array([0, 4], dtype=np.uint8).reshape(1, 2, 1)).reshape(n, 16)
    high = (scales[:, 8:].reshape(n, 1, 4) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 4, 1))
    sc = (low & np.uint8(0x0F)) | ((high.reshape(n, 16) & np.uint8(0x03)) << np.uint8(4))
    dl = d[:, None] * (sc.astype(np.int8) - np.int8(32)).astype(np.float32)
    ql = (qs.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & np.uint8(3)
    qh = (hmask.reshape(n, 1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)) & np.uint8(1)
    q = ql.reshape(n, QK_K).astype(np.int8) - ((qh.reshape(n, QK_K) ^ np.uint8(1)) << np.uint8(2)).astype(np.int8)
    return Unpacked(q, dl, None, 16)


def _k_scale_offset(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    d, dmin = _f16(b[:, :2]).astype(np.float32), _f16(b[:, 2:4]).astype(np.float32)
    sc, mins = _k_scales(b[:, 4:16])
    return d[:, None] * sc.astype(np.float32), -(dmin[:, None] * mins.astype(np.float32))


def _q4_k(b: np.ndarray) -> Unpacked:
    n = b.shape[0]
    scales, offsets = _k_scale_offset(b)
    qs = b[:, 16:].reshape(n, 4, 32)  # 4 chunks of 64 weights: low nibbles 0..31, high nibbles 32..63
    low, high = qs & np.uint8(0x0F), qs >> np.uint8(4)
    sub = np.stack([low, high], axis=2).reshape(n * 8, 32)  # sub-blocks of 32 in order
    return Unpacked(_nibbles_of_32(sub[:, :16], sub[:, 16:]).reshape(n, 128), scales, offsets, 32)


def _q5_k(b: np.ndarray) -> Unpacked:
    n = b.shape[0]
    scales, offsets = _k_scale_offset(b)
    qh, qs = b[:, 16:48], b[:, 48:]
    low = np.stack([qs.reshape(n, 4, 32) & np.uint8(0x0F), qs.reshape(n, 4, 32) >> np.uint8(4)], axis=2)
    high = (qh.reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & np.uint8(1)
    q = low.reshape(n, 8, 32) | (high << np.uint8(4))
    return Unpacked(q.reshape(n, QK_K).astype(np.int8), scales, offsets, 32)


def _q6_k(b: np.ndarray) -> Unpacked:
    n = b.shape[0]
    ql, qh, sc = b[:, :128], b[:, 128:192], b[:, 192:208].view(np.int8)
    d = _f16(b[:, 208:210]).astype(np.float32)
    low = (ql.reshape(n, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & np.uint8(0x0F)
    high = (qh.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & np.uint8(3)
    q = (low.reshape(n, 8, 32) | (high.reshape(n, 8, 32) << np.uint8(4))).astype(np.int8) - np.int8(32)
    return Unpacked(q.reshape(n, QK_K), d[:, None] * sc.astype(np.float32), None, 16)


_UNPACK = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q2_K": _q2_k,
           "Q3_K": _q3_k, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}


def dequantize(unpacked: Unpacked, dtype: np.dtype = np.float32) -> np.ndarray:
    """scale * code + offset per weight, in float32 (then cast): the reference the kernels are held to."""
    codes = unpacked.codes
    if unpacked.nibbles:
        rows = codes.shape[0]
        pairs = codes.reshape(rows, -1, 16)
        codes = np.concatenate([pairs & np.uint8(0x0F), pairs >> np.uint8(4)], axis=-1).reshape(rows, -1)
    values = codes.astype(np.float32).reshape(codes.shape[0], -1, unpacked.group)
    values = values * unpacked.scales.astype(np.float32)[..., None]
    if unpacked.offsets is not None:
        values = values + unpacked.offsets.astype(np.float32)[..., None]
    return values.reshape(codes.shape[0], -1).astype(dtype, copy=False)
