"""A weight matrix kept quantized: GGUF's block types as codes, scales and offsets (model/ggml_quants.py).

A Q4_1 file is 92 MiB; dequantized to float32 it was 538 MB that every decode step read. Kept as codes,
a decode step reads the codes and one scale (and offset) per group, and widens them in registers
(kernels/qgemv.py). `x @ W.T` (`matmul_t`) takes the compiled kernel for up to MAX_KERNEL_ROWS rows of x
(decode, batched decode) and, for more (prefill), dequantizes a tile of weight rows at a time into a
cache-sized float32 buffer and runs BLAS on it: the whole float32 matrix never exists.

The matrix behaves like the [N, K] arrays the model keeps elsewhere where the model needs it to: `shape`,
row selection (llama.cpp's Q/K row permutation is undone on the rows; an embedding lookup gathers rows),
row concatenation (q/k/v and gate/up are fused on load when their types agree) and `fingerprint_bytes`.
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import replace
from typing import Mapping, Sequence

import numpy as np

from kvlab.errors import InputError
from kvlab.kernels.layout import SMALL_BIAS, SMALL_GROUP_MAX
from kvlab.model.ggml_quants import (BLOCK_SIZES, GROUPS, NIBBLE_TYPES, OFFSET_TYPES, Unpacked, dequantize,
                                     resident_bytes, unpack)
from kvlab.model.act_quant import rounded
from kvlab.model.qtiles import (LANES, NIBBLE_GROUP_MAX, expand_scales, factor_scales, from_dot_codes,
                                gather_dot_codes, gather_rows, packed_bits, to_dot_codes, to_packed_codes,
                                to_tiles)

MAX_KERNEL_ROWS = 16
# Types kvlab can encode (llama.cpp's reference encoders in the gguf package); every ggml_quants type reads.
QUANTIZE_TYPES = ("q8_0", "q5_1", "q5_0", "q4_1", "q4_0")
TILE_VALUES = 1 << 18  # float32 values of one dequantized tile in a prefill product (1 MiB: stays in L2)


# types whose offsets are a power of two times the scale, kept as that factor in the float layout's tiles
FOLDED_OFFSETS = {"Q4_0": -8.0}
# 5-bit types whose codes are signed (Q5_0's -16..15): both layouts keep code + bias, 0..31, in 5 bits
# (qtiles.to_dot_codes5), the float layout with the offset -bias * scale folded as Q4_0's -8 is. Q6_K's 6-bit
# codes are kept as code + SMALL_BIAS (qtiles.to_dot_codes6), which the float kernels take off themselves
FIVE_BIT_BIAS = {"Q5_0": 16}
# types whose scales are the file's own float16 (the dot layout keeps them so); the K types' product scales
# (d * sub-block scale) are rarely exact in float16: both layouts keep them factored (an int8 a group, a
# float32 base a super-block and row: qtiles.factor_scales, `factored_tiles`)
HALF_SCALE_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")


def predicted_bytes(type_name: str, shape: tuple[int, int], activations: str = "float32") -> int:
    """Bytes a [N, K] matrix of `type_name` is kept in by a model computing with `activations`, without
    reading it (`kvlab memory --model`): the float layout (ggml_quants.resident_bytes, a K type's scales and
    offsets factored), or for "q8" the integer kernels' layout of the whole tiles (codes alike, scales
    float16 for HALF_SCALE_TYPES, a K type's factored as in the float layout, Q4_0's offsets folded) plus
    the tail rows in the float layout. For the float16-scale types the q8 figure is the file's own bytes."""
    rows, cols = shape
    tiled = rows // LANES * LANES
    k_type = type_name not in HALF_SCALE_TYPES
    if activations != "q8" and not k_type:  # Q4_0's tiles keep no offsets (FOLDED_OFFSETS), its tail rows do
        folded = tiled * cols // GROUPS[type_name] * 4 if type_name in FOLDED_OFFSETS else 0
        unpacked_code_bytes = cols // 2 if type_name in NIBBLE_TYPES else cols  # ggml_quants.resident_bytes's
        return resident_bytes(type_name, shape) - folded - tiled * (unpacked_code_bytes - _code_bytes(type_name, cols))
    code_bytes = _code_bytes(type_name, cols)
    groups = cols // GROUPS[type_name]
    if type_name in HALF_SCALE_TYPES:
        scale_bytes = groups * 2
    else:  # a K type: an int8 a group and a float32 base a super-block, for the scales and the offsets
        scale_bytes = groups + cols // BLOCK_SIZES[type_name][0] * 4
    offset_bytes = 0 if type_name not in OFFSET_TYPES or type_name == "Q4_0" else \
        (groups * 4 if type_name in HALF_SCALE_TYPES else scale_bytes)
    return tiled * (code_bytes + scale_bytes + offset_bytes) + resident_bytes(type_name, (rows - tiled, cols))


def _code_bytes(type_name: str, cols: int) -> int:
    """Bytes of one row's codes in the tiles (either layout): nibbles half a byte, 5- and 6-bit types 5/8 and
    6/8 of a byte (qtiles.to_packed_codes), every other code a byte."""
    if type_name in NIBBLE_TYPES:
        return cols // 2
    bits = packed_bits(type_name, GROUPS[type_name])
    return cols * bits // 8 if bits else cols


class QuantizedMatrix:
    """[N, K] weights as the kernels read them: the whole tiles of 8 rows in ONE of two layouts, and `tail`
    (the N % 8 rows after them, row-ordered codes/scales/offsets, model/qtiles.py, model/ggml_quants.py).

    The layouts: `tiles`, the float kernels' (codes, float32 scales and offsets, interleaved by row: the
    exact products, kernels/qgemv.py; Q4_0's offsets as the factor -8 on the scales, FOLDED_OFFSETS; a K
    type's factored as in the dot layout; 5- and 6-bit codes the dot layout's own array, a nibble and a bit
    or a crumb, Q5_0's as code + 16 with the offset -16 * scale folded, FIVE_BIT_BIAS), and
    `dot_layout`, the integer kernels' (codes in quads, float16 scales where exact, a K type's factored,
    Q4_0's offsets folded into a bias: `activations="q8"`, kernels/qdot.py). Asking
    for one converts from the other and drops it (a permutation of the same codes, the same values), so a
    model keeps one copy of its codes in either mode; the embedding lookup, `rows`, `dequantize` and the
    NumPy reference read whichever layout is resident without converting. A conversion happens when a
    model binds its kernels (LlamaModel.set_activations), once per matrix, under a lock."""

    def __init__(self, type_name: str, tiles: Unpacked | None, tail: Unpacked) -> None:
        self.type_name = type_name
        self.tail = tail
        self._tiles: Unpacked | None = tiles
        self._dot: tuple[np.ndarray, np.ndarray, np.ndarray, int, np.ndarray, np.ndarray] | None = None
        self._lock = threading.Lock()
        self.view_of: tuple[QuantizedMatrix, int, int] | None = None  # (matrix, start, stop): see row_view

    @classmethod
    def from_unpacked(cls, type_name: str, unpacked: Unpacked) -> "QuantizedMatrix":
        """The matrix of row-ordered codes/scales/offsets, tiled for the kernels (a transpose, once). Q4_0's
        offsets (-8 * scale by definition) are kept for the tail rows only: the tiles hold the factor
        (Unpacked.offset_scale), read by the kernels as the scales times -8 (qgemv.kernel_args)."""
        folded = type_name in FOLDED_OFFSETS and unpacked.offsets is not None
        if folded:
            whole = unpacked.scales.shape[0] // LANES * LANES
            unpacked = Unpacked(unpacked.codes, unpacked.scales, unpacked.offsets[whole:], unpacked.group)
        tiles, tail = to_tiles(unpacked, tail_offsets_only=folded)
        if folded:
            tiles = Unpacked(tiles.codes, tiles.scales, None, tiles.group, FOLDED_OFFSETS[type_name])
        bits = packed_bits(type_name, unpacked.group)
        if bits:  # 5 or 6 bits a code, as the file (qtiles.to_packed_codes)
            tiles = Unpacked(to_packed_codes(tiles.codes, unpacked.scales.shape[1], bits, _code_bias(type_name)),
                             tiles.scales, tiles.offsets, tiles.group, _folded_bias(type_name))
        return cls(type_name, factored_tiles(type_name, tiles), tail)

    @classmethod
    def from_blocks(cls, type_name: str, raw: np.ndarray, shape: tuple[int, int]) -> "QuantizedMatrix":
        """The matrix stored as ggml blocks of `type_name` (the tensor's bytes, e.g. a memory map)."""
        return cls.from_unpacked(type_name, unpack(type_name, raw, shape))

    @classmethod
    def quantize(cls, weight: np.ndarray, type_name: str) -> "QuantizedMatrix":
        """`weight` [N, K] quantized to `type_name` with llama.cpp's own encoder (the `gguf` package)."""
        import gguf

        kind = gguf.GGMLQuantizationType[type_name]
        raw = gguf.quants.quantize(np.ascontiguousarray(weight, dtype=np.float32), kind)
        return cls.from_blocks(type_name, raw, tuple(weight.shape))

    # --- the two layouts ----------------------------------------------------------------------------------
    @property
    def layout(self) -> str:
        """Which layout of the tiles is resident: "float" (`tiles`) or "dot" (`dot_layout`)."""
        return "float" if self._tiles is not None else "dot"

    @property
    def tiles(self) -> Unpacked:
        """The float kernels' layout (converted back from the dot layout, which is dropped, if that is the
        resident one)."""
        with self._lock:
            if self._tiles is None:
                self._tiles, self._dot = self._float_tiles(), None
            return self._tiles

    @property
    def dot_layout(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, np.ndarray, np.ndarray]:
        """(codes, scales, offsets, bias, base scales, base offsets): the tiles as the integer kernels read
        them (kernels/qdot.py), made from the float layout, which is dropped. Codes in quads
        (qtiles.to_dot_codes; 5- and 6-bit types' as a nibble and a bit or a crumb: qtiles.to_packed_codes,
        Q5_0's bias 16, Q6_K's SMALL_BIAS); scales float16 where that is exact (the file's own float16: every
        type but the K types); a K type's scales and offsets (d * sub-block scale) as int8 per group times a float32
        base per super-block and row (qtiles.factor_scales: the same float32 values, a quarter of the
        bytes), else float32; Q4_0's offsets (-8 * scale) folded into bias 8 rather than read; int8 codes
        bias 128 (the kernel's code + 128), or beside factored scales (Q6_K, Q3_K) layout.SMALL_BIAS 32.
        float16 scales travel as their bits (uint16): numba has no float16 arrays. Base arrays have no
        columns where the scales are not factored."""
        with self._lock:
            if self._dot is None:
                self._dot, self._tiles = self._make_dot(self._tiles), None
            return self._dot

    def _make_dot(self, t: Unpacked) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, np.ndarray, np.ndarray]:
        if t.nibbles and self.group > NIBBLE_GROUP_MAX:  # no GGUF type: its nibble groups are 32 columns
            raise ValueError(f"{self.type_name}: nibble groups of {self.group} columns are wider than the integer "
                             f"kernels' 16-bit pair sums allow ({NIBBLE_GROUP_MAX})")
        scales, offsets, base_scales, base_offsets = self._dot_scales(t)
        if self._packed:  # the float layout's own codes (a nibble and a bit or a crumb a code)
            return t.codes, scales, offsets, _code_bias(self.type_name), base_scales, base_offsets
        codes = to_dot_codes(t.codes, self.tail.scales.shape[1])
        no_offsets = np.zeros((0, 0), dtype=np.float32)
        if t.offsets is None and t.offset_scale == -8.0:  # folded already: Q4_0's bias 8
            return codes, scales, no_offsets, 8, base_scales, base_offsets
        if not t.nibbles and scales.dtype == np.int8:  # a K type's small codes: code + SMALL_BIAS, unsigned
            if (self.group > SMALL_GROUP_MAX or t.codes.min(initial=0) < -SMALL_BIAS
                    or t.codes.max(initial=0) >= SMALL_BIAS):
                raise ValueError(f"{self.type_name}: int8 codes beside factored scales must lie in "
                                 f"-{SMALL_BIAS}..{SMALL_BIAS - 1}, in groups of at most {SMALL_GROUP_MAX} columns")
            return codes, scales, offsets, SMALL_BIAS, base_scales, base_offsets
        if not t.nibbles:
            return codes, scales, offsets, 128, base_scales, base_offsets
        if t.offsets is not None and t.base_scales is None and np.array_equal(t.offsets, t.scales * np.float32(-8)):
            return codes, scales, no_offsets, 8, base_scales, base_offsets
        return codes, scales, offsets, 0, base_scales, base_offsets

    def _dot_scales(self, t: Unpacked) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(scales, offsets, base scales, base offsets) of the dot layout for the float layout's tiles `t`:
        float16 bits where exact, a K type's factored ints and bases, else float32 (`dot_layout`)."""
        none = np.zeros((0, 0), dtype=np.float32)
        offsets = none if t.offsets is None else t.offsets
        if t.base_scales is not None:  # factored already (a K type's float layout): the same arrays
            return t.scales, offsets, t.base_scales, none if t.base_offsets is None else t.base_offsets
        with np.errstate(over="ignore"):  # a K type's product scale past float16's range: not float16
            half = t.scales.astype(np.float16)
        if np.array_equal(half.astype(np.float32), t.scales):
            return half.view(np.uint16), offsets, none, none
        if self.type_name.endswith("_K"):
            per = BLOCK_SIZES[self.type_name][0] // self.group
            factored = factor_scales(t.scales, per)
            factored_offsets = None if t.offsets is None else factor_scales(t.offsets, per)
            if factored is not None and (t.offsets is None or factored_offsets is not None):
                offsets, base_offsets = factored_offsets if factored_offsets is not None else (none, none)
                return factored[0], offsets, factored[1], base_offsets
        return t.scales, offsets, none, none

    @staticmethod
    def _widen(values: np.ndarray, base: np.ndarray) -> np.ndarray:
        """Dot-layout scales or offsets [T, G * 8] (float16 bits, factored int8, or float32) as float32."""
        if values.dtype == np.uint16:
            return values.view(np.float16).astype(np.float32)
        if values.dtype == np.int8:
            return expand_scales(values, base)
        return values

    def _dot_scales_offsets(self) -> tuple[np.ndarray, np.ndarray | None]:
        """The dot layout's tiled scales and offsets as the float layout holds them (float32, exact)."""
        _, scales, offsets, bias, base_scales, base_offsets = self._dot
        scales = self._widen(scales, base_scales)
        if self.tail.offsets is None:  # the tail keeps offsets exactly when the tiles had them
            return scales, None
        return scales, (scales * np.float32(-8) if bias == 8 else self._widen(offsets, base_offsets))

    def _float_tiles(self) -> Unpacked:
        """The float layout, whichever is resident (a new array when it is the dot layout)."""
        if self._tiles is not None:
            return self._tiles
        dot_codes, dot_scales, dot_offsets, bias, base_scales, base_offsets = self._dot
        # 5- and 6-bit codes: the same array in both layouts; others are quads here, columns there
        codes = dot_codes if self._packed else from_dot_codes(dot_codes, self.tail.scales.shape[1], bias)
        if dot_scales.dtype == np.int8:  # a K type's factored scales: the float layout keeps them so too
            return Unpacked(codes, dot_scales, dot_offsets if dot_offsets.shape[0] else None, self.group, None,
                            base_scales, base_offsets if base_offsets.size else None)
        scales, offsets = self._dot_scales_offsets()
        if self._packed:
            return Unpacked(codes, scales, offsets, self.group, _folded_bias(self.type_name))
        fold = FOLDED_OFFSETS.get(self.type_name)
        if fold is not None and offsets is not None and self._dot[3] == 8:
            return Unpacked(codes, scales, None, self.group, fold)
        return Unpacked(codes, scales, offsets, self.group)

    # --- array-like -------------------------------------------------------------------------------------
    @property
    def group(self) -> int:
        return self.tail.group

    @property
    def _packed(self) -> int:
        """The bits a code both layouts keep the codes in below a byte (qtiles.to_packed_codes): 5, 6 or 0."""
        return packed_bits(self.type_name, self.group)

    @property
    def unpacked(self) -> Unpacked:
        """Row-ordered codes, scales, offsets (a transpose of the tiles: for load-time work, not per step)."""
        return self.rows(slice(None))

    @property
    def scales(self) -> np.ndarray:
        """[N, K / group] float32, row order."""
        return self.rows(slice(None), codes=False).scales

    @property
    def offsets(self) -> np.ndarray | None:
        return self.rows(slice(None), codes=False).offsets

    @property
    def shape(self) -> tuple[int, int]:
        groups = self.tail.scales.shape[1]
        tiles = self._tiles.scales.shape[0] if self._tiles is not None else self._dot[0].shape[0]
        return (tiles * LANES + self.tail.scales.shape[0], groups * self.group)

    ndim = 2

    @property
    def nbytes(self) -> int:
        """Resident bytes (the resident layout's codes, scales and offsets, and the tail's; no row padded)."""
        with self._lock:
            t = self._tiles
            arrays = ((*self._dot[:3], *self._dot[4:]) if t is None else
                      (t.codes, t.scales, t.offsets, t.base_scales, t.base_offsets))
            tail = (self.tail.codes, self.tail.scales, self.tail.offsets)
            return sum(a.nbytes for a in (*arrays, *tail) if a is not None)

    def resident_bytes(self, activations: str = "float32") -> int:
        """What a model computing with `activations` keeps of this matrix: the float layout, or for "q8" the
        dot layout (the same codes, 5-bit ones packed; scales float16 where exact; no offsets for Q4_0), plus
        the tail. Counted without converting: the arrays' sizes follow from the type and shape."""
        want = "dot" if activations == "q8" else "float"
        if want == self.layout:
            return self.nbytes
        tiled = self.shape[0] - self.tail.scales.shape[0]
        groups = self.tail.scales.shape[1]
        codes = tiled * _code_bytes(self.type_name, self.shape[1])
        tail = sum(a.nbytes for a in (self.tail.codes, self.tail.scales, self.tail.offsets) if a is not None)
        if want == "float":
            if self._dot[1].dtype == np.int8:  # factored: the float layout keeps the same arrays
                return codes + sum(a.nbytes for a in (*self._dot[1:3], *self._dot[4:])) + tail
            per_group = 4 * (2 if self.type_name in OFFSET_TYPES and self.type_name not in FOLDED_OFFSETS else 1)
            return codes + tiled * groups * per_group + tail
        scales = self._dot_scales(self._tiles)  # as `_make_dot` decides (the codes are not converted)
        return codes + sum(a.nbytes for a in scales) + tail

    @property
    def file_bytes(self) -> int:
        """The bytes the same matrix takes as ggml blocks in a GGUF file."""
        block, size = BLOCK_SIZES[self.type_name]
        return self.shape[0] * self.shape[1] // block * size

    def __len__(self) -> int:
        return self.shape[0]

    def __repr__(self) -> str:
        return f"QuantizedMatrix({self.type_name}, shape={self.shape}, layout={self.layout}, nbytes={self.nbytes})"

    def rows(self, index: np.ndarray | slice, codes: bool = True) -> Unpacked:
        """Rows `index` (a permutation, a gather or a slice) row-ordered, read from the resident layout
        directly (no conversion: an embedding lookup costs the rows it takes); `codes=False` leaves the
        codes out (None): scales and offsets only."""
        if isinstance(index, slice):
            index = np.arange(self.shape[0])[index]
        with self._lock:
            t = self._tiles
            if t is not None and self._packed:  # the codes as the dot layout's (below), the scales gathered
                index = np.asarray(index, dtype=np.int64).reshape(-1)
                picked = gather_rows(*self._widened_tiles(index, False)) if t.base_scales is not None else \
                    gather_rows(Unpacked(None, t.scales, t.offsets, t.group), self.tail, index)
                return replace(picked, codes=self._picked_codes(t.codes, index, _code_bias(self.type_name))
                               if codes else None)
            if t is not None and t.base_scales is not None:
                return gather_rows(*self._widened_tiles(np.asarray(index, dtype=np.int64).reshape(-1), codes))
            if t is not None:
                picked = gather_rows(t if codes else Unpacked(None, t.scales, t.offsets, t.group), self.tail, index)
                if t.offsets is None and t.offset_scale is not None:  # folded: every row's offset is scale * factor
                    picked = Unpacked(picked.codes, picked.scales, picked.scales * np.float32(t.offset_scale),
                                      picked.group)
                return picked
            # the dot layout: only the rows taken are widened (an embedding lookup per decode step must not
            # convert the whole table's scales)
            index = np.asarray(index, dtype=np.int64).reshape(-1)
            dot_codes, dot_scales, dot_offsets, bias, base_scales, base_offsets = self._dot
            whole = dot_scales.shape[0] * LANES
            inside, tail_rows = index < whole, index[index >= whole] - whole
            # the tiles the rows sit in, widened to float32 (factored scales need their bases)
            needed, moved = _holding_tiles(index, dot_scales.shape[0])
            local = moved[inside]
            tiled = gather_rows(Unpacked(None, self._widen(dot_scales[needed], base_scales[needed] if base_scales.size
                                                           else base_scales),
                                         self._widen(dot_offsets[needed], base_offsets[needed] if base_offsets.size
                                                     else base_offsets) if dot_offsets.shape[0] else None,
                                         self.group), self.tail, local)
            widened = tiled.scales
            scales = np.empty((index.shape[0], self.tail.scales.shape[1]), dtype=np.float32)
            scales[inside], scales[~inside] = widened, self.tail.scales[tail_rows]
            offsets = None
            if self.tail.offsets is not None:  # the tail keeps offsets exactly when the tiles had them
                offsets = np.empty_like(scales)
                offsets[inside] = widened * np.float32(-8) if bias == 8 else tiled.offsets
                offsets[~inside] = self.tail.offsets[tail_rows]
            return Unpacked(self._picked_codes(dot_codes, index, bias) if codes else None, scales, offsets, self.group)

    def _picked_codes(self, dot_codes: np.ndarray, index: np.ndarray, bias: int) -> np.ndarray:
        """Row-ordered codes of rows `index` (int64) from dot-layout codes (bias taken off) and the tail."""
        whole = dot_codes.shape[0] * LANES
        inside = index < whole
        picked = np.empty((index.shape[0], self.tail.codes.shape[1]), dtype=self.tail.codes.dtype)
        picked[inside] = gather_dot_codes(dot_codes, index[inside], bias)
        picked[~inside] = self.tail.codes[index[~inside] - whole]
        return picked

    def _widened_tiles(self, index: np.ndarray, codes: bool) -> tuple[Unpacked, Unpacked, np.ndarray]:
        """(tiles, tail, index) for `gather_rows` from a float layout with factored scales: only the tiles
        the rows sit in, their scales and offsets widened to float32 (base * int, exact), `index` moved to
        them (an embedding lookup must not widen the whole table)."""
        t = self._tiles
        needed, moved = _holding_tiles(index, t.scales.shape[0])
        offsets = None if t.offsets is None else self._widen(t.offsets[needed], t.base_offsets[needed])
        return (Unpacked(t.codes[needed] if codes else None, self._widen(t.scales[needed], t.base_scales[needed]),
                         offsets, t.group), self.tail, moved)

    def row_view(self, start: int, stop: int) -> "QuantizedMatrix":
        """Rows start:stop sharing this matrix's arrays when both ends fall on tile boundaries (or stop is
        the last row), else a copy (`take_rows`). Why: a reader that stacks q/k/v (gate/up) once hands the
        model views of the stack, and `concat` of the views in order gives the stack back, so a model is
        built with one copy of its codes, not the parts and their stack side by side."""
        rows = self.shape[0]
        whole = rows - self.tail.scales.shape[0]
        if start % LANES or (stop % LANES and stop != rows) or not 0 <= start <= stop <= rows:
            return self.take_rows(slice(start, stop))
        t0, t1 = start // LANES, max(start, min(stop, whole)) // LANES
        tail = self.tail if stop == rows else Unpacked(
            self.tail.codes[:0].copy(), self.tail.scales[:0].copy(),
            None if self.tail.offsets is None else self.tail.offsets[:0].copy(), self.tail.group)
        with self._lock:
            t, dot = self._tiles, self._dot
        if t is not None:
            def part(a: np.ndarray | None) -> np.ndarray | None:
                return None if a is None else a[t0:t1]

            view = QuantizedMatrix(self.type_name, Unpacked(t.codes[t0:t1], t.scales[t0:t1], part(t.offsets), t.group,
                                                            t.offset_scale, part(t.base_scales),
                                                            part(t.base_offsets)), tail)
        else:  # the same rows of the integer kernels' layout (an empty offsets array means none: kept as is)
            codes, scales, offsets, bias, base_scales, base_offsets = dot

            def rows_of(a: np.ndarray) -> np.ndarray:  # an array with no rows means none: kept as is
                return a[t0:t1] if a.shape[0] else a

            view = QuantizedMatrix(self.type_name, None, tail)
            view._dot = (codes[t0:t1], scales[t0:t1], rows_of(offsets), bias, rows_of(base_scales),
                         rows_of(base_offsets))
        view.view_of = (self, start, stop)
        return view

    def take_rows(self, index: np.ndarray | slice) -> "QuantizedMatrix":
        """The matrix of rows `index` (a permutation, a gather or a slice)."""
        return QuantizedMatrix.from_unpacked(self.type_name, self.rows(index))

    @staticmethod
    def can_concat(parts: Sequence[object]) -> bool:
        """Whether `parts` stack into one matrix: all quantized alike (type, group, widths)."""
        first = parts[0]
        if not all(isinstance(p, QuantizedMatrix) for p in parts):
            return False
        return all(p.type_name == first.type_name and p.group == first.group and p.shape[1] == first.shape[1]
                   for p in parts)

    @staticmethod
    def concat(parts: Sequence["QuantizedMatrix"]) -> "QuantizedMatrix":
        """Rows of `parts` one after another (q, k, v -> qkv); they must satisfy `can_concat`."""
        if not QuantizedMatrix.can_concat(parts):
            raise ValueError("only matrices of one quantization type, group and width stack")
        whole = parts[0].view_of[0] if parts[0].view_of else None
        spans = [p.view_of[1:] if p.view_of and p.view_of[0] is whole else None for p in parts]
        if whole is not None and None not in spans and spans[0][0] == 0 and spans[-1][1] == whole.shape[0] \
                and all(a[1] == b[0] for a, b in zip(spans, spans[1:])):
            return whole  # views of one matrix, in order and covering it: that matrix, no copy
        rows = [p.unpacked for p in parts]
        offsets = None if rows[0].offsets is None else np.concatenate([u.offsets for u in rows])
        joined = Unpacked(np.concatenate([u.codes for u in rows]), np.concatenate([u.scales for u in rows]),
                          offsets, parts[0].group)
        return QuantizedMatrix.from_unpacked(parts[0].type_name, joined)

    def fingerprint_into(self, digest: "hashlib._Hash") -> None:
        """`digest.update(self.fingerprint_bytes())`, fed a band of rows at a time: the same digest without
        the whole row-ordered copy (and its bytes, twice) that building the bytes takes."""
        digest.update(self.type_name.encode() + b"\0" + str(self.group).encode())
        rows = self.shape[0]
        step = max(LANES, TILE_VALUES // self.shape[1] * LANES)
        fields = ("codes", "scales") + (() if self.tail.offsets is None else ("offsets",))
        for field in fields:
            digest.update(b"\0")
            for start in range(0, rows, step):
                band = self.rows(slice(start, start + step), codes=field == "codes")
                digest.update(np.ascontiguousarray(getattr(band, field)).reshape(-1).view(np.uint8))

    def fingerprint_bytes(self) -> bytes:
        """Canonical bytes of the weights (type, group, codes, scales, offsets, row-ordered: the layout the
        kernels read does not change a model's fingerprint) for the model fingerprint."""
        u = self.unpacked
        parts = [self.type_name.encode(), str(self.group).encode(), u.codes.tobytes(), u.scales.tobytes()]
        if u.offsets is not None:
            parts.append(u.offsets.tobytes())
        return b"\0".join(parts)

    # --- products ---------------------------------------------------------------------------------------
    def dequantize(self, dtype: np.dtype = np.float32, rows: slice | np.ndarray = slice(None)) -> np.ndarray:
        """Rows `rows` (a slice, or row indices: an embedding lookup) as floats, exactly the file's dequantized
        values (the reference)."""
        part = self.unpacked if isinstance(rows, slice) and rows == slice(None) else self.rows(rows)
        return dequantize(part, np.dtype(dtype))

    def matmul_t(self, x: np.ndarray, compiled: bool = True, activations: str = "float32") -> np.ndarray:
        """x [..., K] @ W.T -> [..., N] in x's dtype: the compiled kernel for a few rows, else tiles + BLAS.
        `activations="q8"`: x rounded to int8 per group first (model/act_quant.py); compiled, any number of
        rows then takes the integer kernel (kernels/qdot.py; a prefill too: README's llama.cpp table has
        it beside the bands + BLAS), so a row's product does not depend on how many rows share the call;
        the NumPy reference multiplies the rounded x by the dequantized bands."""
        flat = np.ascontiguousarray(x.reshape(-1, x.shape[-1]))
        if flat.shape[0] == 0:  # no rows (an engine step whose prefill chunk needs no logits): the kernels want one
            return np.zeros((*x.shape[:-1], self.shape[0]), dtype=x.dtype)
        if activations == "q8" and compiled and flat.dtype == np.float32:
            from kvlab.kernels.qgemv import qmatmul_dot

            out = qmatmul_dot(flat, self.dot_layout, self.tail)
        elif activations == "q8":
            out = self._tiled(rounded(flat, self.group).astype(flat.dtype, copy=False), compiled=False)
        elif compiled and flat.shape[0] <= MAX_KERNEL_ROWS and flat.dtype == np.float32:
            from kvlab.kernels.qgemv import qmatmul

            out = qmatmul(flat, self.tiles, self.tail)
        else:
            out = self._tiled(flat, compiled)
        return out.reshape(*x.shape[:-1], self.shape[0])

    def _tiled(self, x: np.ndarray, compiled: bool) -> np.ndarray:
        """x @ W.T a band of rows at a time: each band dequantized into a cache-sized float32 buffer (the
        compiled kernel straight from the tiles, else NumPy) and multiplied by BLAS there."""
        rows, width = self.shape
        out = np.empty((x.shape[0], rows), dtype=x.dtype)
        step = max(LANES, TILE_VALUES // width // LANES * LANES)
        buffer = np.empty((width, min(step, rows)), dtype=np.float32)   # W.T's band: [K, rows]
        whole = self.tiles.scales.shape[0] * LANES
        for start in range(0, rows, step):
            stop = min(start + step, rows)
            band_t = buffer[:, :stop - start]
            if compiled and stop <= whole:
                from kvlab.kernels.qgemv import dequantize_tiles_t

                dequantize_tiles_t(self.tiles, start // LANES, stop // LANES, band_t)
            else:
                band_t[...] = dequantize(self.rows(slice(start, stop))).T
            # into a contiguous product, then copied: a matmul whose `out` is a column slice skips BLAS
            out[:, start:stop] = x @ band_t.astype(x.dtype, copy=False)
        return out


def prepare_layout(matrix: object, activations: str) -> None:
    """Make the layout `activations` reads resident now (the dot layout for "q8", else the float one), so
    a model's memory is settled when it is bound, not at its first logits; anything but a QuantizedMatrix
    is left as it is; a RowStack's parts each."""
    for part in getattr(matrix, "parts", ()):
        prepare_layout(part, activations)
    if isinstance(matrix, QuantizedMatrix):
        _ = matrix.dot_layout if activations == "q8" else matrix.tiles


def quant_type(name: str) -> str:
    """'q8_0' / 'Q8_0' -> 'Q8_0'; InputError naming the choices for anything else."""
    if not isinstance(name, str) or name.lower() not in QUANTIZE_TYPES:
        raise InputError(f"unknown weight quantization {name!r}; choose from {', '.join(QUANTIZE_TYPES)}")
    return name.upper()


def weight_choice(name: str) -> tuple[str, str]:
    """A weight choice as `kvlab fidelity --weights` names it: "q4_0" -> ("Q4_0", "float32"); "q4_0+q8" ->
    ("Q4_0", "q8"), the products' inputs rounded to int8 too (model/act_quant.py)."""
    kind, plus, activations = str(name).partition("+")
    if plus and activations.lower() != "q8":
        raise InputError(f"unknown activations in {name!r}: only '+q8' (inputs rounded to int8) follows a type")
    return quant_type(kind), "q8" if plus else "float32"


def quantize_weights(weights: Mapping[str, np.ndarray], type_name: str,
                     ) -> dict[str, np.ndarray | QuantizedMatrix]:
    """Every 2-D float matrix of `weights` (embeddings and LM head included, as llama-quantize does for a
    single --type) as a QuantizedMatrix of `type_name`; 1-D tensors (norms, biases) unchanged."""
    kind = quant_type(type_name)
    return {name: QuantizedMatrix.quantize(w, kind) if np.ndim(w) == 2 else w for name, w in weights.items()}


def dequantized(weights: Mapping[str, np.ndarray | QuantizedMatrix]) -> dict[str, np.ndarray]:
    """Quantized matrices as float32 arrays of their exact values (for a float model of the same weights)."""
    return {name: w.dequantize() if isinstance(w, QuantizedMatrix) else w for name, w in weights.items()}


class RowStack:
    """Matrices stacked by rows that cannot become one QuantizedMatrix (types differ: Q4_K_M files keep
    v_proj in Q6_K beside Q4_K q/k): `matmul_t` runs each part and joins the outputs."""

    ndim = 2

    def __init__(self, parts: Sequence[np.ndarray | QuantizedMatrix]) -> None:
        self.parts = list(parts)
        self.shape = (sum(p.shape[0] for p in self.parts), self.parts[0].shape[1])

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def matmul_t(self, x: np.ndarray, compiled: bool = True, activations: str = "float32") -> np.ndarray:
        outs = [p.matmul_t(x, compiled, activations) if isinstance(p, QuantizedMatrix)
                else np.asarray(x @ p.T.astype(x.dtype, copy=False)) for p in self.parts]
        return np.concatenate(outs, axis=-1)


QuantizedLinear = (QuantizedMatrix, RowStack)


def _code_bias(type_name: str) -> int:
    """What packed codes hold above the file's (qtiles.to_packed_codes): Q5_0's 16, Q6_K's SMALL_BIAS, else 0."""
    return SMALL_BIAS if packed_bits(type_name, GROUPS[type_name]) == 6 else FIVE_BIT_BIAS.get(type_name, 0)


def _folded_bias(type_name: str) -> float | None:
    """The float layout's offset factor for packed codes that keep a bias (Q5_0's -16: offset = -16 * scale,
    FIVE_BIT_BIAS); None for the rest (Q6_K's 32 the float kernels take off themselves)."""
    bias = FIVE_BIT_BIAS.get(type_name)
    return -float(bias) if bias else None


def _holding_tiles(index: np.ndarray, tiles: int) -> tuple[np.ndarray, np.ndarray]:
    """(needed, moved): the tiles (of `tiles` whole ones) that rows `index` sit in, sorted and once each, and
    `index` moved onto them (tail rows moved to follow them), so that a lookup widens only the tiles it
    reads, not a whole table's scales."""
    whole = tiles * LANES
    inside = index < whole
    needed, local = np.unique(index[inside] // LANES, return_inverse=True)
    moved = index - whole + needed.shape[0] * LANES
    moved[inside] = local.reshape(-1) * LANES + index[inside] % LANES
    return needed, moved


def factored_tiles(type_name: str, tiles: Unpacked) -> Unpacked:
    """A K type's tiles with their scales (and offsets) factored where that is exact (qtiles.factor_scales:
    an int8 a group, a float32 base a super-block and row), so that both layouts keep 1 byte a group, not 4;
    other types' tiles, and a K type whose values do not factor, as they are."""
    if not type_name.endswith("_K") or tiles.base_scales is not None:
        return tiles
    per = BLOCK_SIZES[type_name][0] // tiles.group
    scales = factor_scales(tiles.scales, per)
    offsets = None if tiles.offsets is None else factor_scales(tiles.offsets, per)
    if scales is None or (tiles.offsets is not None and offsets is None):
        return tiles
    return Unpacked(tiles.codes, scales[0], None if offsets is None else offsets[0], tiles.group, None, scales[1],
                    None if offsets is None else offsets[1])


def stack_rows(parts: Sequence[np.ndarray | QuantizedMatrix]) -> QuantizedMatrix | RowStack:
    """Row-stacked matrices (q/k/v, gate/up) where at least one is quantized: one matrix when they agree,
    else a RowStack of the runs that agree (a Q4_K_M layer's Q4_K q and k as one matrix beside its Q6_K v:
    one product fewer a step)."""
    if QuantizedMatrix.can_concat(parts):
        return QuantizedMatrix.concat(parts)
    runs: list[list[np.ndarray | QuantizedMatrix]] = []
    for part in parts:
        if runs and QuantizedMatrix.can_concat([runs[-1][0], part]):
            runs[-1].append(part)
        else:
            runs.append([part])
    return RowStack([QuantizedMatrix.concat(run) if len(run) > 1 else run[0] for run in runs])
