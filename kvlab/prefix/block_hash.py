"""Chained block keys for the prefix cache: SHA-256 over canonical bytes, the same in every process.

A block's K/V depend on every token before it, so its key covers its parent's key (which covers the
parent's parent, ...) plus its own token ids and any extra keys. The root is what makes the K/V valid at
all (ARCHITECTURE.md invariant 6): the model fingerprint, the compute and cache dtypes and an optional per-tenant
`cache_salt`, so two tenants never share blocks (vLLM GHSA-rm76-4mrf-v9r8). Python's `hash()` is
per-process and predictable; it is never used here.
"""

from __future__ import annotations

import hashlib
import json
import struct
from typing import Any, Sequence

import numpy as np

from kvlab.cache.quant import QuantFormat


def _digest(tag: bytes, *parts: bytes) -> bytes:
    h = hashlib.sha256(tag)
    for part in parts:
        h.update(struct.pack("<Q", len(part)))  # length-prefixed: no two part lists share their bytes
        h.update(part)
    return h.digest()


def _dtype_name(dtype: Any) -> str:
    """"float16", or a quantized format's name ("int8", "fp8_e4m3"): blocks of different precision never mix."""
    return dtype.name if isinstance(dtype, QuantFormat) else np.dtype(dtype).name


def root_key(fingerprint: str, compute_dtype: Any, cache_dtype: Any, cache_salt: str | None = None) -> bytes:
    """The parent key of a sequence's first block."""
    header = json.dumps({"fingerprint": fingerprint, "compute_dtype": np.dtype(compute_dtype).name,
                         "cache_dtype": _dtype_name(cache_dtype), "cache_salt": cache_salt},
                        sort_keys=True).encode()
    return _digest(b"kvlab-root-v1", header)


def block_key(parent: bytes, token_ids: Sequence[int], extra_keys: Sequence[Any] = ()) -> bytes:
    """Key of a full block: its parent's key, its token ids (int64 little-endian) and extra keys (JSON)."""
    tokens = np.asarray(token_ids, dtype="<i8").tobytes()
    extra = json.dumps(list(extra_keys), sort_keys=True).encode() if extra_keys else b""
    return _digest(b"kvlab-block-v1", parent, tokens, extra)
