"""Exceptions kvlab raises on bad input.

Each one names the problem; every call that raises them validates before it mutates, so the caches, pools
and files involved are left exactly as they were.
"""


class KVLabError(Exception):
    """Base class for kvlab's own errors."""


class ConfigError(KVLabError, ValueError):
    """A model config (dataclass or config.json) is invalid or unsupported."""


class InputError(KVLabError, ValueError):
    """Token ids or other call arguments are malformed (rank, dtype, range, batch)."""


class ContextLengthError(InputError):
    """The request would place a position past max_position_embeddings."""


class CacheMismatchError(KVLabError, ValueError):
    """A cache is used with a model (fingerprint, dtype, batch) other than the one that produced it."""


class CheckpointError(KVLabError, ValueError):
    """A model folder or cache file is missing, truncated, corrupt or inconsistent with its config."""
