"""The safetensors format, read and written with NumPy alone.

Why not `safetensors.numpy`: it cannot load bfloat16 from bytes and needs ml_dtypes imported first for
files; the format itself is tiny (an 8-byte little-endian header length, a JSON header of
`name -> {dtype, shape, data_offsets}`, then the raw little-endian payload), so reading the header
ourselves lets us validate every entry against the real file size *before* touching the payload and then
memory-map it: a truncated or corrupt file raises CheckpointError naming the file and the tensor, never a
segfault or a half-loaded model. No pickle is involved anywhere.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import ml_dtypes
import numpy as np

from kvlab.errors import CheckpointError

# safetensors dtype codes we can map onto NumPy. Weights must be floats; ints are accepted for other uses.
DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
    "U8": np.dtype("u1"), "BOOL": np.dtype("?"),
}
CODES: dict[np.dtype, str] = {dtype: code for code, dtype in DTYPES.items()}
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the reference implementation's limit


@dataclass(frozen=True)
class TensorInfo:
    """One header entry: where the tensor's bytes are in the file (absolute offsets) and what they are."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class SafetensorsHeader:
    path: Path
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]
    file_size: int


def read_header(path: str | Path) -> SafetensorsHeader:
    """Parse and validate the header of a .safetensors file without reading the payload."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            head += f.read(_header_length(path, head, size))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file not found") from None
    except IsADirectoryError:
        raise CheckpointError(f"{path}: is a directory, expected a .safetensors file") from None
    return parse_header(head, size, path)


def _header_length(path: Path, prefix: bytes, size: int) -> int:
    if len(prefix) < 8:
        raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header length)")
    header_len = int.from_bytes(prefix[:8], "little")
    if header_len > MAX_HEADER_BYTES or 8 + header_len > size:
        raise CheckpointError(f"{path}: bad safetensors header length {header_len} for a file of "
                              f"{size} bytes (truncated or not a safetensors file)")
    return header_len


def parse_header(head: bytes, file_size: int, path: str | Path) -> SafetensorsHeader:
    """Validate the header at the start of `head` (at least its first 8 + N bytes) for a file of `file_size`.

    Checks: the length prefix fits the file, the JSON is an object, every dtype is known, every shape is a
    list of non-negative ints whose byte size equals its offsets span, and offsets lie inside the file
    without overlapping. Callers that hold the whole file (session files, which hash it) pass it here too.
    """
    path = Path(path)
    header_len = _header_length(path, head, file_size)
    try:
        header = json.loads(bytes(head[8: 8 + header_len]).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: safetensors header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: safetensors header must be a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise CheckpointError(f"{path}: __metadata__ must be a JSON object")
    base = 8 + header_len
    payload = file_size - base
    tensors = {name: _parse_entry(path, name, entry, base, payload) for name, entry in header.items()}
    spans = sorted((t.start, t.end, t.name) for t in tensors.values() if t.end > t.start)
    for (_, end_a, name_a), (start_b, _, name_b) in zip(spans, spans[1:]):
        if start_b < end_a:
            raise CheckpointError(f"{path}: tensors {name_a!r} and {name_b!r} overlap in the file")
    return SafetensorsHeader(path, tensors, {str(k): str(v) for k, v in metadata.items()}, file_size)


def tensors_from_buffer(header: SafetensorsHeader, blob: bytes) -> dict[str, np.ndarray]:
    """Read-only arrays over a whole file already in memory (`blob`), as `header` describes them."""
    if len(blob) != header.file_size:
        raise CheckpointError(f"{header.path}: expected {header.file_size} bytes, got {len(blob)}")
    return {t.name: np.frombuffer(blob, dtype=t.dtype, count=math.prod(t.shape), offset=t.start).reshape(t.shape)
            for t in header.tensors.values()}


def _parse_entry(path: Path, name: str, entry: object, base: int, payload: int) -> TensorInfo:
    if not isinstance(entry, dict):
        raise CheckpointError(f"{path}: header entry {name!r} is not an object")
    code = entry.get("dtype")
    if code not in DTYPES:
        raise CheckpointError(f"{path}: tensor {name!r} has unknown or unsupported dtype {code!r} "
                              f"(supported: {', '.join(DTYPES)})")
    shape = entry.get("shape")
    offsets = entry.get("data_offsets")
    if not (isinstance(shape, list) and all(type(n) is int and n >= 0 for n in shape)):
        raise CheckpointError(f"{path}: tensor {name!r} has a malformed shape {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(n) is int for n in offsets)
            and 0 <= offsets[0] <= offsets[1]):
        raise CheckpointError(f"{path}: tensor {name!r} has malformed data_offsets {offsets!r}")
    dtype = DTYPES[code]
    need = math.prod(shape) * dtype.itemsize
    if offsets[1] - offsets[0] != need:
        raise CheckpointError(f"{path}: tensor {name!r} spans {offsets[1] - offsets[0]} bytes but shape "
                              f"{tuple(shape)} of {code} needs {need}")
    if offsets[1] > payload:
        raise CheckpointError(f"{path}: tensor {name!r} ends at byte {base + offsets[1]} past the end of the "
                              f"file ({base + payload} bytes): the file is truncated")
    return TensorInfo(name, dtype, tuple(shape), base + offsets[0], base + offsets[1])


def open_tensors(header: SafetensorsHeader) -> dict[str, np.ndarray]:
    """Read-only arrays over the file's payload (memory-mapped: nothing is read until used)."""
    if header.file_size == 0 or not header.tensors:
        return {}
    try:
        mm = np.memmap(header.path, dtype=np.uint8, mode="r")
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{header.path}: cannot memory-map ({exc})") from None
    if mm.shape[0] != header.file_size:
        raise CheckpointError(f"{header.path}: file changed size while loading")
    return {t.name: mm[t.start:t.end].view(t.dtype).reshape(t.shape) for t in header.tensors.values()}


def load_file(path: str | Path) -> dict[str, np.ndarray]:
    """All tensors of one file as memory-mapped, read-only arrays (validated header first)."""
    return open_tensors(read_header(path))


def save_file(tensors: Mapping[str, np.ndarray], path: str | Path,
              metadata: Mapping[str, str] | None = None) -> None:
    """Write tensors in the safetensors format (readable by the `safetensors` package and transformers).

    Written to a temporary file and renamed into place, so a failed save never leaves a truncated file.
    """
    path = Path(path)
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    arrays = []
    offset = 0
    for name in sorted(tensors):
        array = np.asarray(tensors[name])
        if not array.flags.c_contiguous:
            array = array.copy(order="C")  # (np.ascontiguousarray would turn a 0-d array into 1-d)
        if array.dtype.byteorder == ">":
            array = array.astype(array.dtype.newbyteorder("<"))
        code = CODES.get(array.dtype)
        if code is None:
            raise ValueError(f"tensor {name!r}: dtype {array.dtype} has no safetensors code")
        header[name] = {"dtype": code, "shape": list(array.shape), "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
        arrays.append(array)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # keep the payload 8-byte aligned, as the reference writer does
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for array in arrays:
            f.write(array.reshape(-1).view(np.uint8))
    os.replace(tmp, path)
