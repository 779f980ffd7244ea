"""The GGUF container: header, metadata and tensor directory, validated, with the payload memory-mapped.

Why parse the header here rather than with `gguf.GGUFReader`: the reader fails on a bad file with a bare
numpy error ("cannot reshape array of size 0 ...") and decodes every vocabulary string into its own array
objects. This walks the format once (magic, version, counts, key/value pairs, tensor infos, alignment),
checks every offset against the file size as it goes, and says which key or tensor is wrong. The `gguf`
package (llama.cpp's own) still defines the tensor types and their block sizes, and dequantizes.

Layout (version 2 and 3, little-endian): b"GGUF", u32 version, u64 tensor count, u64 metadata count;
each metadata entry is a string key, a u32 value type and the value; each tensor info is a string name,
u32 n_dims, n_dims x u64 sizes (innermost first), u32 ggml type, u64 offset into the data section, which
starts at the next multiple of `general.alignment` (default 32). Strings are a u64 length plus UTF-8.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvlab.errors import CheckpointError

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# metadata value type -> (struct code, numpy dtype); 8 = string and 9 = array are handled apart
SCALARS: dict[int, tuple[str, str]] = {
    0: ("B", "<u1"), 1: ("b", "<i1"), 2: ("H", "<u2"), 3: ("h", "<i2"), 4: ("I", "<u4"), 5: ("i", "<i4"),
    6: ("f", "<f4"), 7: ("?", "?"), 10: ("Q", "<u8"), 11: ("q", "<i8"), 12: ("d", "<f8"),
}
STRING, ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the directory. `shape` is in NumPy order (outermost first): ggml's sizes reversed."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    type_name: str
    start: int  # absolute byte offset in the file
    nbytes: int


@dataclass
class GGUFFile:
    """A parsed GGUF file: metadata by key, tensors by name, and the memory-mapped bytes."""

    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]
    data: np.ndarray  # uint8 memmap of the whole file

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes (a view into the memory map, nothing read yet)."""
        info = self.tensors[name]
        return self.data[info.start:info.start + info.nbytes]

    def release(self, name: str) -> None:
        """Drop the tensor's pages from this process's resident set once they are read (the file stays in
        the page cache): a mapped page counts in RSS until unmapped, so reading a file whole otherwise
        peaks at the weights as kept plus the whole file (measured: 1.57 GiB for a 578 MiB Q4_0 file)."""
        buffer = getattr(self.data, "_mmap", None)  # np.memmap's mmap object
        if buffer is None or not hasattr(buffer, "madvise") or not hasattr(mmap, "MADV_DONTNEED"):
            return
        info = self.tensors[name]
        offset = getattr(self.data, "offset", 0)
        start = (offset + info.start) // mmap.PAGESIZE * mmap.PAGESIZE
        stop = min(offset + info.start + info.nbytes, len(buffer))
        if stop > start:
            buffer.madvise(mmap.MADV_DONTNEED, start, stop - start)

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def number(self, key: str, default: float) -> float:
        """A numeric metadata value (`default` when absent), or a CheckpointError naming the key."""
        value = self.metadata.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise CheckpointError(f"{self.path}: metadata {key!r} must be a number, got {value!r}")
        return float(value)


class _Cursor:
    """Reads little-endian values from the header, naming what it was reading when the file ends."""

    def __init__(self, path: Path, buffer: mmap.mmap) -> None:
        self.path, self.buffer, self.size, self.offset = path, buffer, len(buffer), 0

    def take(self, count: int, what: str) -> bytes:
        if count < 0 or self.offset + count > self.size:
            raise CheckpointError(f"{self.path}: truncated while reading {what} (needs bytes up to "
                                  f"{self.offset + count}, the file has {self.size})")
        raw = self.buffer[self.offset:self.offset + count]
        self.offset += count
        return raw

    def unpack(self, code: str, what: str) -> Any:
        return struct.unpack("<" + code, self.take(struct.calcsize(code), what))[0]

    def string(self, what: str) -> str:
        length = self.unpack("Q", what)
        raw = self.take(length, what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise CheckpointError(f"{self.path}: {what} is not valid UTF-8 ({exc})") from None

    def strings(self, count: int, what: str) -> list[str]:
        """`count` strings in a row (vocabularies: 10^5 of them, so this loop is kept tight)."""
        out, buffer, offset, size = [], self.buffer, self.offset, self.size
        unpack = struct.Struct("<Q").unpack_from
        for i in range(count):
            if offset + 8 > size:
                break
            (length,) = unpack(buffer, offset)
            if offset + 8 + length > size:
                break
            try:
                out.append(buffer[offset + 8:offset + 8 + length].decode("utf-8"))
            except UnicodeDecodeError as exc:
                raise CheckpointError(f"{self.path}: {what}[{i}] is not valid UTF-8 ({exc})") from None
            offset += 8 + length
        self.offset = offset
        if len(out) < count:
            self.string(f"{what}[{len(out)}]")  # raises the truncation error
        return out

    def value(self, kind: int, what: str) -> Any:
        if kind in SCALARS:
            value = self.unpack(SCALARS[kind][0], what)
            return bool(value) if kind == 7 else value
        if kind == STRING:
            return self.string(what)
        if kind == ARRAY:
            item_kind = self.unpack("I", what)
            count = self.unpack("Q", what)
            if item_kind in SCALARS:
                dtype = np.dtype(SCALARS[item_kind][1])
                raw = self.take(count * dtype.itemsize, what)
                return np.frombuffer(raw, dtype=dtype).copy()  # small: scores, token types
            if item_kind == STRING:
                return self.strings(count, what)
            if item_kind == ARRAY:
                return [self.value(ARRAY, f"{what}[{i}]") for i in range(count)]
            raise CheckpointError(f"{self.path}: {what} has unknown array item type {item_kind}")
        raise CheckpointError(f"{self.path}: {what} has unknown value type {kind}")


def read_gguf(path: str | Path) -> GGUFFile:
    """Parse and validate a GGUF file's header and tensor directory; the payload stays memory-mapped."""
    try:
        import gguf  # noqa: F401  (llama.cpp's package defines the tensor types)
    except ImportError:
        raise CheckpointError(f"{path}: reading GGUF files needs the gguf package "
                              "(pip install 'kvlab[gguf]')") from None
    path = Path(path)
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such file") from None
    if size < 24:
        raise CheckpointError(f"{path}: truncated ({size} bytes): too short for a GGUF header")
    data = np.memmap(path, dtype=np.uint8, mode="r")
    with open(path, "rb") as handle:
        header = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        return _parse(path, size, data, _Cursor(path, header))
    finally:
        header.close()


def _parse(path: Path, size: int, data: np.ndarray, cursor: _Cursor) -> GGUFFile:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    magic = bytes(cursor.take(4, "the magic"))
    if magic != MAGIC:
        raise CheckpointError(f"{path}: not a GGUF file (magic {magic!r}, expected {MAGIC!r})")
    version = cursor.unpack("I", "the version")
    if version not in (2, 3):
        swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
        hint = " (a big-endian file; only little-endian is supported)" if swapped in (2, 3) else ""
        raise CheckpointError(f"{path}: GGUF version {version} is not supported (2 or 3){hint}")
    tensor_count = cursor.unpack("Q", "the tensor count")
    kv_count = cursor.unpack("Q", "the metadata count")
    if tensor_count > size or kv_count > size:
        raise CheckpointError(f"{path}: corrupt header (tensor count {tensor_count}, metadata count {kv_count})")

    metadata: dict[str, Any] = {}
    for i in range(kv_count):
        key = cursor.string(f"metadata key #{i}")
        kind = cursor.unpack("I", f"the type of metadata {key!r}")
        if key in metadata:
            raise CheckpointError(f"{path}: metadata key {key!r} appears twice")
        metadata[key] = cursor.value(kind, f"metadata {key!r}")

    infos = []
    for i in range(tensor_count):
        name = cursor.string(f"the name of tensor #{i}")
        n_dims = cursor.unpack("I", f"tensor {name!r}")
        if not 1 <= n_dims <= 4:
            raise CheckpointError(f"{path}: tensor {name!r} has {n_dims} dimensions (1 to 4 allowed)")
        sizes = [cursor.unpack("Q", f"tensor {name!r}") for _ in range(n_dims)]
        ggml_type = cursor.unpack("I", f"tensor {name!r}")
        offset = cursor.unpack("Q", f"tensor {name!r}")
        infos.append((name, sizes, ggml_type, offset))

    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise CheckpointError(f"{path}: metadata 'general.alignment' must be a power of two, got {alignment!r}")
    data_start = -(-cursor.offset // alignment) * alignment

    tensors: dict[str, TensorInfo] = {}
    for name, sizes, ggml_type, offset in infos:
        if name in tensors:
            raise CheckpointError(f"{path}: tensor {name!r} appears twice")
        try:
            qtype = GGMLQuantizationType(ggml_type)
        except ValueError:
            raise CheckpointError(f"{path}: tensor {name!r} has unknown ggml type {ggml_type}") from None
        block, type_size = GGML_QUANT_SIZES[qtype]
        if sizes[0] % block:
            raise CheckpointError(f"{path}: tensor {name!r} rows of {sizes[0]} are not a whole number of "
                                  f"{qtype.name} blocks of {block}")
        nbytes = int(np.prod(sizes, dtype=np.int64)) // block * type_size
        start = data_start + offset
        if offset % alignment:
            raise CheckpointError(f"{path}: tensor {name!r} offset {offset} is not aligned to {alignment}")
        if start + nbytes > size:
            raise CheckpointError(f"{path}: truncated: tensor {name!r} needs bytes up to {start + nbytes}, "
                                  f"the file has {size}")
        tensors[name] = TensorInfo(name, tuple(int(s) for s in reversed(sizes)), ggml_type, qtype.name, start,
                                   nbytes)
    return GGUFFile(path, version, metadata, tensors, data)
