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
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import safetensors.numpy

from kvlab import validate
from kvlab.cache.dtypes import resolve_kv_dtype
from kvlab.cache.kv_cache import KVCache
from kvlab.errors import CacheMismatchError, CheckpointError, InputError
from kvlab.hf.safetensors import SafetensorsHeader, parse_header, tensors_from_buffer
from kvlab.model.llama import LlamaModel

FORMAT, VERSION = "kvlab.session", 1
_ZEROS = "0" * 64


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
    path = Path(validate.path_text(path, "session file"))
    extra = validate.json_dict(extra, "session extra")  # what cannot load back is never saved
    length = cache.get_seq_length()
    if cache.quantized:
        raise InputError(f"session files hold float K/V rows; a {cache.dtype.name} cache cannot be saved "
                         "(use a float cache dtype for sessions and prompt caches)")
    if cache.batch_size != 1 or len(tokens) != length:
        raise InputError(f"a session file holds one sequence with one row per token; got batch "
                         f"{cache.batch_size}, {length} rows and {len(tokens)} tokens")
    spec = cache.spec
    meta = {"format": FORMAT, "version": VERSION, "fingerprint": spec.fingerprint,
            "compute_dtype": np.dtype(spec.compute_dtype).name, "kv_dtype": cache.dtype.name,
            "num_layers": spec.num_layers, "num_kv_heads": spec.num_kv_heads, "head_dim": spec.head_dim,
            "num_tokens": length, "tokens": [int(t) for t in tokens],
            "positions": [int(p) for p in cache.positions], "extra": extra}
    meta_json = json.dumps(meta, sort_keys=True, ensure_ascii=False, allow_nan=False)
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


def _read_verified(path: Path) -> tuple[bytes, SafetensorsHeader]:
    """The file's bytes and its validated header, after the checksum matched."""
    try:
        blob = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such session file") from None
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read ({exc.strerror or exc})") from None
    header = parse_header(blob, len(blob), path)
    metadata = header.metadata
    if "kvlab" not in metadata or "sha256" not in metadata:
        raise CheckpointError(f"{path}: not a kvlab session file (no kvlab metadata or checksum)")
    digest = metadata["sha256"]
    if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        raise CheckpointError(f"{path}: corrupt checksum field")
    header_end = 8 + int.from_bytes(blob[:8], "little")
    try:
        span = _digest_span(blob, header_end, digest)
    except CheckpointError as exc:
        raise CheckpointError(f"{path}: {exc}") from None
    if _sha256_zeroed(blob, span) != digest:
        raise CheckpointError(f"{path}: checksum mismatch: the file was truncated, corrupted or modified "
                              "after it was written")
    return blob, header


def _int_list(value: Any, length: int, high: int | None = None) -> bool:
    return (isinstance(value, list) and len(value) == length
            and all(type(v) is int and v >= 0 and (high is None or v < high) for v in value))


def read_session_file(path: str | Path, model: LlamaModel, kv_dtype: object = None) -> SavedSession:
    """Verify and load a session file for `model`.

    CheckpointError / CacheMismatchError, and nothing loaded, if it is damaged, from another model or
    compute dtype, or (when `kv_dtype` is given) holds another cache dtype.
    """
    path = Path(validate.path_text(path, "session file"))
    blob, header = _read_verified(path)
    try:
        meta = json.loads(header.metadata["kvlab"])
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
    if set(header.tensors) != names:
        raise CheckpointError(f"{path}: expected tensors layers.0..{spec.num_layers - 1}.keys/values")
    shape = (1, spec.num_kv_heads, length, spec.head_dim)
    for info in header.tensors.values():
        if info.dtype != stored or info.shape != shape:
            raise CheckpointError(f"{path}: tensor {info.name!r} is not {stored.name} {list(shape)}")
    arrays = tensors_from_buffer(header, blob)
    keys = [arrays[f"layers.{i}.keys"] for i in range(spec.num_layers)]
    values = [arrays[f"layers.{i}.values"] for i in range(spec.num_layers)]
    cache = KVCache.from_arrays(spec, keys, values, np.asarray(meta["positions"], dtype=np.int64), stored)
    return SavedSession(cache=cache, tokens=list(meta["tokens"]), extra=meta["extra"])
