"""One tier value per block: a small JSON header, then the raw K/V bytes of every layer. No pickle.

    magic (8 bytes) | version (u16 LE) | header length (u32 LE) | header (UTF-8 JSON) | payload

The header names the block's tier key, its parent's, the block size, the token ids it holds, the layout
(dtype and shape of one layer's arrays, the layer count), the payload length and its SHA-256. One key per
block, header and payload together, so an LRU eviction can never keep one half (LMCache #426 split them
over two keys). `decode` trusts nothing: every field is checked against what the caller expects, and the
digest against the payload, before a single byte reaches the pool; anything else raises TierEntryError
naming what was wrong.
"""

from __future__ import annotations

import hashlib
import math
import json
import struct
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from kvlab.errors import KVLabError
from kvlab.tier.keys import FORMAT_VERSION

MAGIC = b"KVLABKV\x00"
_PREFIX = struct.Struct("<8sHI")
MAX_HEADER_BYTES = 1 << 20


class TierEntryError(KVLabError, ValueError):
    """A stored block is corrupt, truncated, of another format, or not the block that was asked for."""


@dataclass(frozen=True)
class Expected:
    """What the block under a key must be: its key, parent key, tokens and this pool's layout."""

    key: bytes
    parent: bytes
    token_ids: tuple[int, ...]
    layout: dict[str, Any]
    dtypes: Sequence[np.dtype]


def encode(key: bytes, parent: bytes, token_ids: Sequence[int], layout: dict[str, Any],
           arrays: Sequence[np.ndarray]) -> bytes:
    """The value stored for one block: header and payload."""
    payload = b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)
    header = json.dumps({"key": key.hex(), "parent": parent.hex(), "block_size": len(token_ids),
                         "token_ids": [int(t) for t in token_ids], "num_layers": layout["num_layers"],
                         "parts": layout["parts"], "payload_bytes": len(payload),
                         "sha256": hashlib.sha256(payload).hexdigest()}, separators=(",", ":")).encode()
    return _PREFIX.pack(MAGIC, FORMAT_VERSION, len(header)) + header + payload


def _field(header: dict, name: str, kind: type) -> Any:
    value = header.get(name)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise TierEntryError(f"header field {name!r} is missing or not a {kind.__name__}")
    return value


def decode(value: bytes, expected: Expected) -> list[np.ndarray]:
    """The block's arrays, in block_io order, if `value` is exactly the expected block; else TierEntryError."""
    if len(value) < _PREFIX.size:
        raise TierEntryError(f"truncated: {len(value)} bytes is shorter than the {_PREFIX.size}-byte prefix")
    magic, version, header_len = _PREFIX.unpack_from(value)
    if magic != MAGIC:
        raise TierEntryError("foreign entry: bad magic, not a kvlab block")
    if version != FORMAT_VERSION:
        raise TierEntryError(f"format version {version}; this kvlab reads version {FORMAT_VERSION}")
    if header_len > MAX_HEADER_BYTES or _PREFIX.size + header_len > len(value):
        raise TierEntryError(f"truncated: header of {header_len} bytes does not fit in {len(value)} bytes")
    try:
        header = json.loads(value[_PREFIX.size:_PREFIX.size + header_len])
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TierEntryError(f"corrupt header: not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise TierEntryError("corrupt header: not a JSON object")
    payload = memoryview(value)[_PREFIX.size + header_len:]
    declared = _field(header, "payload_bytes", int)
    if len(payload) != declared:
        raise TierEntryError(f"truncated: payload is {len(payload)} bytes, the header says {declared}")
    if _field(header, "sha256", str) != hashlib.sha256(payload).hexdigest():
        raise TierEntryError("corrupt: the payload's SHA-256 differs from the header's")
    if _field(header, "key", str) != expected.key.hex():
        raise TierEntryError("wrong block: the header names another key")
    if _field(header, "parent", str) != expected.parent.hex():
        raise TierEntryError("wrong block: the header names another parent")
    tokens = _field(header, "token_ids", list)
    if tuple(tokens) != tuple(expected.token_ids) or not all(type(t) is int for t in tokens):
        raise TierEntryError("wrong block: its token ids differ from the prompt's")
    layout = {"num_layers": _field(header, "num_layers", int), "parts": _field(header, "parts", list)}
    if layout != expected.layout:
        raise TierEntryError(f"foreign layout {layout}; this pool's blocks are {expected.layout}")
    arrays, offset = [], 0
    parts = expected.layout["parts"] * expected.layout["num_layers"]
    for part, dtype in zip(parts, expected.dtypes):
        count = math.prod(part["shape"])
        size = count * dtype.itemsize
        if offset + size > len(payload):
            raise TierEntryError("truncated: the payload is shorter than its layout")
        arrays.append(np.frombuffer(payload, dtype=dtype, count=count, offset=offset).reshape(part["shape"]))
        offset += size
    if offset != len(payload):
        raise TierEntryError(f"corrupt: {len(payload) - offset} payload bytes beyond the layout")
    return arrays
