"""Write-through off the engine thread: a bounded queue and one background writer.

The engine thread only copies a full block's arrays and puts them on the queue (`put_nowait`: it never
waits); when the queue is full the block is dropped and counted, as the tier is a cache and a missing
block only costs a recompute elsewhere. The writer encodes each block once (the SHA-256 runs here, not
on the engine thread) and writes it to every tier that is up. `close(timeout)` drains what is queued
within the timeout (a graceful shutdown), then counts the rest as dropped.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable

from kvlab.tier.backend import TierUnavailable
from kvlab.tier.health import TierLink
from kvlab.tier.stats import TierStats

log = logging.getLogger("kvlab.tier")

_STOP = object()


class WriteQueue:
    """`submit(name, encode)` from the engine thread; a daemon thread writes to every link that is up."""

    def __init__(self, links: list[TierLink], stats: TierStats, maxsize: int = 1024) -> None:
        self.links = links
        self.stats = stats
        self._queue: queue.Queue = queue.Queue(maxsize)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvlab-tier-writer", daemon=True)
        self._thread.start()

    def full(self) -> bool:
        return self._queue.full()

    def submit(self, name: str, encode: Callable[[], bytes]) -> bool:
        """Queue a block (its key name and a function that encodes it); False (counted) if dropped."""
        if self._closed or not any(link.allows() for link in self.links):
            self.stats.add("kv_tier_dropped_writes")
            return False
        try:
            self._queue.put_nowait((name, encode))
        except queue.Full:
            self.stats.add("kv_tier_dropped_writes")
            return False
        return True

    def _run(self) -> None:
        for link in self.links:  # connect at start, off the engine thread; a tier down now is logged now
            ping = getattr(link.backend, "ping", None)
            if ping is not None:
                try:
                    ping()
                except TierUnavailable as exc:
                    link.failed(exc)
                    self.stats.add("kv_tier_errors")
        while True:
            item = self._queue.get()
            try:
                if item is _STOP:
                    return
                self._write(*item)
            except Exception:  # never let the writer die: a bad block is dropped
                log.exception("kv tier write failed")
                self.stats.add("kv_tier_dropped_writes")
            finally:
                self._queue.task_done()

    def _write(self, name: str, encode: Callable[[], bytes]) -> None:
        value: bytes | None = None
        written = False
        for link in self.links:
            if not link.allows():
                continue
            if value is None:
                value = encode()
            try:
                if link.backend.put(name, value):
                    self.stats.add("kv_tier_written_bytes", len(value))
                    written = True
                link.succeeded()
            except TierUnavailable as exc:
                link.failed(exc)
                self.stats.add("kv_tier_errors")
        if written:
            self.stats.add("kv_tier_written_blocks")
        elif value is None:
            self.stats.add("kv_tier_dropped_writes")

    def flush(self, timeout: float) -> bool:
        """Wait until everything queued so far is written (or dropped); False if `timeout` passed first."""
        deadline = time.monotonic() + timeout
        with self._queue.all_tasks_done:
            while self._queue.unfinished_tasks:
                left = deadline - time.monotonic()
                if left <= 0 or not self._thread.is_alive():
                    return False
                self._queue.all_tasks_done.wait(left)
        return True

    def close(self, timeout: float) -> bool:
        """Stop taking blocks, write what is queued within `timeout`, drop (and count) the rest."""
        self._closed = True
        drained = self.flush(timeout)
        if not drained:  # give up on what is left
            while True:
                try:
                    self._queue.get_nowait()
                except queue.Empty:
                    break
                self.stats.add("kv_tier_dropped_writes")
                self._queue.task_done()
        try:
            self._queue.put_nowait(_STOP)
        except queue.Full:
            pass
        self._thread.join(max(0.0, min(timeout, 1.0)))
        return drained
