"""Tier keys: the prefix cache's chained block key, bound to the block size and the tier's format version.

A block's chain key (kvlab/prefix/block_hash.py) already commits to its root (model fingerprint, compute
and cache dtypes, the optional per-tenant cache_salt) and to every token before and in it. Wrapping it
once more with the block size and `FORMAT_VERSION` is the same as putting those two at the root: two
instances of one model with one block size and format agree on every key across processes and machines,
and anything else (another model, dtype, block size, format, salt) never matches. It also lets a tier
key be derived from the local key alone, so the tier keeps no chain of its own. Salted blocks live
under keys that include their salt: no one without the salt can name them.
"""

from __future__ import annotations

import hashlib
import struct

FORMAT_VERSION = 1
KEY_PREFIX = "kvlab:kv:"  # a namespace in a shared Redis/Valkey; also the file tier's file stem prefix


def tier_key(chain_key: bytes, block_size: int) -> bytes:
    """The 32-byte tier key of the block whose prefix-cache chain key is `chain_key`."""
    h = hashlib.sha256(b"kvlab-tier")
    h.update(struct.pack("<II", FORMAT_VERSION, int(block_size)))
    h.update(chain_key)
    return h.digest()


def key_name(key: bytes) -> str:
    """The key as stored: a printable name in kvlab's namespace."""
    return f"{KEY_PREFIX}v{FORMAT_VERSION}:{key.hex()}"
