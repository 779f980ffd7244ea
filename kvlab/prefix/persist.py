"""Session files: a KV cache and its token ids on disk, like llama.cpp's prompt-cache and slot files.

One safetensors file per session. Tensors `layers.{i}.keys` / `layers.{i}.values` hold each layer's rows
[1, H_kv, T, d] in the cache dtype; the header's `__metadata__` holds two strings:

* `kvlab`: JSON with the format name and version, model fingerprint, compute and cache dtypes, shape, token
  ids, positions and the application's `extra` data;
* `sha256`: a SHA-256 over every byte of the file as written, with these 64 hex digits read as zeros.

So a change to any byte (payload, header, metadata, padding, the digest itself) is caught, and a file
truncated or cut off by a crash is refused. The digest guards integrity, not authenticity: whoever can
write the file can also recompute it. Files are written to a temporary name and renamed into place, so a
crash never leaves a half-written file under the real name. Reading parses the bytes we hashed (no second
read of the file, no pickle), validates everything, and only then builds the cache.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import ml_dtypes
import numpy as np
import safetensors.numpy

from kvlab.cache.kv_cache import KVCache, resolve_kv_dtype
from kvlab.errors import CacheMismatchError, CheckpointError, InputError
from kvlab.model.llama import LlamaModel

FORMAT, VERSION = "kvlab.session", 1
_ZEROS = "0" * 64
_DTYPES = {"F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
           "BF16": np.dtype(ml_dtypes.bfloat16)}
_MAX_HEADER = 100 * 1024 * 1024


@dataclass(frozen=True)
class SavedSession:
    """What a session file restores: the rebuilt cache, the token ids of its rows, the application data."""

    cache: KVCache
    tokens: list[int]
    extra: dict[str, Any]


def _digest_span(blob: bytes | bytearray, header_end: int, digest: str) -> tuple[int, int]:
    """Byte range of the digest's 64 hex characters in the header; it must occur exactly once."""
    pattern = b'"sha256":"' + digest.encode() + b'"'
    at = blob.find(pattern, 8, header_end)
    if at < 0 or blob.find(pattern, at + 1, header_end) >= 0:
        raise CheckpointError("the checksum field is missing or ambiguous")
    start = at + len(b'"sha256":"')
    return start, start + 64


def _sha256_zeroed(blob: bytes | bytearray, span: tuple[int, int]) -> str:
    view = memoryview(blob)
    h = hashlib.sha256(view[: span[0]])
    h.update(_ZEROS.encode())
    h.update(view[span[1]:])
    return h.hexdigest()


def write_session_file(path: str | Path, cache: KVCache, tokens: Sequence[int],
                       extra: dict[str, Any]) -> None:
    """Write `cache` (batch 1, one row per token of `tokens`) and `extra` (JSON-able) to `path` atomically."""
    path = Path(path)
    length = cache.get_seq_length()
    if cache.batch_size != 1 or len(tokens) != length:
        raise InputError(f"a session file holds one sequence with one row per token; got batch "
                         f"{cache.batch_size}, {length} rows and {len(tokens)} tokens")
    spec = cache.spec
    meta = {"format": FORMAT, "version": VERSION, "fingerprint": spec.fingerprint,
            "compute_dtype": np.dtype(spec.compute_dtype).name, "kv_dtype": cache.dtype.name,
            "num_layers": spec.num_layers, "num_kv_heads": spec.num_kv_heads, "head_dim": spec.head_dim,
            "num_tokens": length, "tokens": [int(t) for t in tokens],
            "positions": [int(p) for p in cache.positions], "extra": extra}
    try:
        meta_json = json.dumps(meta, sort_keys=True, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InputError(f"session extra data must be JSON-serializable ({exc})") from None
    tensors = {}
    for i, (keys, values) in enumerate(cache):
        tensors[f"layers.{i}.keys"] = np.ascontiguousarray(keys)
        tensors[f"layers.{i}.values"] = np.ascontiguousarray(values)
    blob = bytearray(safetensors.numpy.save(tensors, metadata={"kvlab": meta_json, "sha256": _ZEROS}))
    span = _digest_span(blob, 8 + int.from_bytes(blob[:8], "little"), _ZEROS)
    blob[span[0]:span[1]] = _sha256_zeroed(blob, span).encode()
    _atomic_write(path, blob)


def _atomic_write(path: Path, blob: bytes | bytearray) -> None:
    """Temp file in the same folder, fsync, rename: readers see the old file or the new one, never half."""
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent or ".")
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot write ({exc.strerror or exc})") from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise CheckpointError(f"{path}: cannot write ({exc.strerror or exc})") from None
        raise
    try:  # make the rename itself durable; not every platform lets us open a folder
        dir_fd = os.open(path.parent or ".", os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError:
        pass


def _read_verified(path: Path) -> tuple[bytes, dict[str, Any], int]:
    """The file's bytes, its parsed header and where the payload starts, after the checksum matched."""
    try:
        blob = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such session file") from None
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if len(blob) < 8:
        raise CheckpointError(f"{path}: truncated ({len(blob)} bytes): not a session file")
    header_len = int.from_bytes(blob[:8], "little")
    if header_len > min(_MAX_HEADER, len(blob) - 8):
        raise CheckpointError(f"{path}: truncated or corrupt (header of {header_len} bytes in a file of "
                              f"{len(blob)})")
    try:
        header = json.loads(blob[8: 8 + header_len].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: corrupt header ({exc})") from None
    metadata = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(metadata, dict) or not isinstance(metadata.get("kvlab"), str) \
            or not isinstance(metadata.get("sha256"), str):
        raise CheckpointError(f"{path}: not a kvlab session file (no kvlab metadata or checksum)")
    digest = metadata["sha256"]
    if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        raise CheckpointError(f"{path}: corrupt checksum field")
    try:
        span = _digest_span(blob, 8 + header_len, digest)
    except CheckpointError as exc:
        raise CheckpointError(f"{path}: {exc}") from None
    if _sha256_zeroed(blob, span) != digest:
        raise CheckpointError(f"{path}: checksum mismatch: the file was truncated, corrupted or modified "
                              "after it was written")
    return blob, header, 8 + header_len


def _tensor(blob: bytes, base: int, name: str, entry: Any, dtype: np.dtype,
            shape: tuple[int, ...]) -> np.ndarray:
    """One tensor as a read-only view of `blob`, after checking its dtype, shape and byte range."""
    if not isinstance(entry, dict) or _DTYPES.get(entry.get("dtype")) != dtype \
            or entry.get("shape") != list(shape):
        raise CheckpointError(f"tensor {name!r} is not {dtype.name} {list(shape)}")
    offsets = entry.get("data_offsets")
    count = math.prod(shape)
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
            and 0 <= offsets[0] and offsets[1] - offsets[0] == count * dtype.itemsize
            and base + offsets[1] <= len(blob)):
        raise CheckpointError(f"tensor {name!r} has bad data offsets {offsets!r}")
    if count == 0:
        return np.zeros(shape, dtype)
    return np.frombuffer(blob, dtype=dtype, count=count, offset=base + offsets[0]).reshape(shape)


def _int_list(value: Any, length: int, high: int | None = None) -> bool:
    return (isinstance(value, list) and len(value) == length
            and all(type(v) is int and v >= 0 and (high is None or v < high) for v in value))


def read_session_file(path: str | Path, model: LlamaModel, kv_dtype: object = None) -> SavedSession:
    """Verify and load a session file for `model`.

    CheckpointError / CacheMismatchError, and nothing loaded, if it is damaged, from another model or
    compute dtype, or (when `kv_dtype` is given) holds another cache dtype.
    """
    path = Path(path)
    blob, header, base = _read_verified(path)
    try:
        meta = json.loads(header["__metadata__"]["kvlab"])
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: corrupt metadata ({exc})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a kvlab session file")
    if meta.get("version") != VERSION:
        raise CheckpointError(f"{path}: session format version {meta.get('version')!r}; this kvlab reads "
                              f"version {VERSION}")
    spec = model.cache_spec
    if meta.get("compute_dtype") != np.dtype(spec.compute_dtype).name:
        raise CacheMismatchError(f"{path}: cache computed in {meta.get('compute_dtype')}, the model runs in "
                                 f"{np.dtype(spec.compute_dtype).name}")
    if meta.get("fingerprint") != spec.fingerprint:
        raise CacheMismatchError(f"{path}: saved by a different model (fingerprint "
                                 f"{str(meta.get('fingerprint'))[:12]} vs {spec.fingerprint[:12]}): cached "
                                 "keys and values are valid only for the exact weights, config and dtype")
    try:
        stored = resolve_kv_dtype(meta.get("kv_dtype"), spec.compute_dtype)
    except InputError:
        raise CheckpointError(f"{path}: unknown cache dtype {meta.get('kv_dtype')!r}") from None
    if kv_dtype is not None and resolve_kv_dtype(kv_dtype, spec.compute_dtype) != stored:
        raise CacheMismatchError(f"{path}: the file holds {stored.name} rows, {kv_dtype} was asked for; "
                                 "converting would change the numbers the rows were computed with")
    length = meta.get("num_tokens")
    if type(length) is not int or length < 0 or length > model.config.max_position_embeddings \
            or [meta.get(k) for k in ("num_layers", "num_kv_heads", "head_dim")] \
            != [spec.num_layers, spec.num_kv_heads, spec.head_dim]:
        raise CheckpointError(f"{path}: cache shape does not match the model")
    if not _int_list(meta.get("tokens"), length, model.config.vocab_size) \
            or not _int_list(meta.get("positions"), length):
        raise CheckpointError(f"{path}: token ids or positions are not {length} valid ints")
    if not isinstance(meta.get("extra"), dict):
        raise CheckpointError(f"{path}: extra data is not a JSON object")
    names = {f"layers.{i}.{kind}" for i in range(spec.num_layers) for kind in ("keys", "values")}
    if set(header) - {"__metadata__"} != names:
        raise CheckpointError(f"{path}: expected tensors layers.0..{spec.num_layers - 1}.keys/values")
    shape = (1, spec.num_kv_heads, length, spec.head_dim)
    try:
        keys = [_tensor(blob, base, f"layers.{i}.keys", header[f"layers.{i}.keys"], stored, shape)
                for i in range(spec.num_layers)]
        values = [_tensor(blob, base, f"layers.{i}.values", header[f"layers.{i}.values"], stored, shape)
                  for i in range(spec.num_layers)]
    except CheckpointError as exc:
        raise CheckpointError(f"{path}: {exc}") from None
    cache = KVCache.from_arrays(spec, keys, values, np.asarray(meta["positions"], dtype=np.int64), stored)
    return SavedSession(cache=cache, tokens=list(meta["tokens"]), extra=meta["extra"])
