"""A tier that failed is left alone for a while, then tried again: local-only meanwhile, never an error.

Without this every request would pay a connect timeout while the tier is down. With it, the first
failure costs one bounded wait, the next `retry_s` seconds skip the tier, and the first call after that
is the reconnect attempt (redis-py reconnects on its own; the file tier just tries again).
"""

from __future__ import annotations

import logging
import threading
import time

from kvlab.tier.backend import TierBackend

log = logging.getLogger("kvlab.tier")


class TierLink:
    """A backend and whether it may be called now."""

    def __init__(self, backend: TierBackend) -> None:
        self.backend = backend
        self.retry_s = float(getattr(backend, "retry_s", 5.0))
        self._down_until: float | None = None
        self._lock = threading.Lock()  # the engine thread (lookups) and the writer thread share a link

    @property
    def up(self) -> bool:
        return self._down_until is None

    def allows(self) -> bool:
        down = self._down_until
        return down is None or time.monotonic() >= down

    def failed(self, error: Exception) -> None:
        with self._lock:
            if self._down_until is None:
                log.warning("kv tier %s is unavailable (%s); serving local-only, retrying in %g s",
                            self.backend.name, error, self.retry_s)
            self._down_until = time.monotonic() + self.retry_s

    def succeeded(self) -> None:
        with self._lock:
            if self._down_until is not None:
                log.warning("kv tier %s is back", self.backend.name)
            self._down_until = None
