"""What a tier backend does: membership of a run of keys, one-round-trip fetch, write-if-absent.

Backends raise TierUnavailable for anything that means "the tier cannot answer now" (refused connection,
timeout, disk error); the caller then serves locally and retries the tier later (kvlab/tier/health.py).
"""

from __future__ import annotations

from typing import Protocol, Sequence

from kvlab.errors import KVLabError


class TierUnavailable(KVLabError, ConnectionError):
    """The tier is down, slow past its timeout, or failing: compute locally instead."""


class TierBackend(Protocol):
    name: str  # for logs and errors: the URL without any password
    retry_s: float  # after a failure, how long the tier is left alone before it is tried again

    def run_length(self, names: Sequence[str]) -> int:
        """How many of `names`, from the first, are present (the longest run of consecutive blocks)."""

    def get_many(self, names: Sequence[str]) -> list[bytes | None]:
        """Their values in one round trip; None for any that vanished since `run_length`."""

    def put(self, name: str, value: bytes) -> bool:
        """Store `value` unless `name` exists (SET NX); True if it was written."""

    def close(self) -> None:
        """Release connections or handles."""
