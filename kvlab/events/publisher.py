"""The KV event publisher: a ZMQ PUB socket the server binds, fed by the engine thread, sent by its own.

Frames are vLLM's: `[topic, seq (8-byte big-endian), msgpack([ts, events, 0])]`. The engine thread only
appends events to a queue; the publisher thread (the only one that touches the socket, as ZMQ requires)
sends whatever has accumulated as one batch, in order, so a step's events usually travel together. The
sequence number starts at 0 in every process: a router that saw a higher one reads the lower one as a
restart and drops this worker's old claims, and the first event of every run is AllBlocksCleared. Only
blocks of unsalted chains are announced (the router would credit a salted block to anyone); a removal is
announced only for a block that was announced.
"""

from __future__ import annotations

import logging
import queue
import struct
import threading
import time
from typing import Any, Sequence

import msgpack
import zmq

from kvlab.errors import ConfigError
from kvlab.events import messages
from kvlab.events.config import KVEventsConfig

log = logging.getLogger("kvlab.events")

MAX_EVENTS_PER_BATCH = 4096  # keeps a payload far below the router's 16 MiB limit
_STOP = object()


class KVEventPublisher:
    """Binds `config.endpoint` now (ConfigError if it cannot); `close()` sends what is queued and unbinds."""

    def __init__(self, config: KVEventsConfig, block_size: int) -> None:
        self.config = config
        self.block_size = int(block_size)
        self.topic = config.topic.encode()
        self.seq = 0
        self.num_queued = 0  # events handed over by the engine thread
        self.num_sent = 0    # events sent (publisher thread); equal to num_queued once all are out
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._announced: set[bytes] = set()  # engine thread only
        self._ready = threading.Event()
        self._error: str | None = None
        self._context = zmq.Context()
        self._thread = threading.Thread(target=self._run, name="kvlab-kv-events", daemon=True)
        self._thread.start()
        self._ready.wait(10)
        if self._error is not None or not self._ready.is_set():
            self._context.term()
            raise ConfigError(f"--kv-events-config: cannot bind {config.endpoint}: {self._error or 'timed out'}")
        self._put(messages.all_blocks_cleared())

    # --- engine thread -----------------------------------------------------------------------------------
    def stored(self, key: bytes, parent: bytes | None, token_ids: Sequence[int]) -> None:
        """Block `key` (parent None at a chain's start) now holds `token_ids`."""
        self._announced.add(key)
        self._put(messages.block_stored(key, parent, token_ids, self.block_size))

    def removed(self, key: bytes) -> None:
        if key in self._announced:
            self._announced.discard(key)
            self._put(messages.block_removed([key]))

    def cleared(self) -> None:
        self._announced.clear()
        self._put(messages.all_blocks_cleared())

    def _put(self, event: dict[str, Any]) -> None:
        self.num_queued += 1
        self._queue.put(event)

    def stats(self) -> dict[str, int]:
        return {"kv_events_queued": self.num_queued, "kv_events_sent": self.num_sent,
                "kv_events_batches": self.seq}

    # --- publisher thread --------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            socket = self._context.socket(zmq.PUB)
            socket.setsockopt(zmq.LINGER, 1000)
            socket.bind(self.config.endpoint)
        except zmq.ZMQError as exc:
            self._error = str(exc)
            self._ready.set()
            return
        self._ready.set()
        try:
            stopping = False
            while not stopping:
                events = [self._queue.get()]
                while len(events) < MAX_EVENTS_PER_BATCH:
                    try:
                        events.append(self._queue.get_nowait())
                    except queue.Empty:
                        break
                if any(e is _STOP for e in events):
                    events = [e for e in events if e is not _STOP]
                    stopping = True
                if events:
                    try:
                        self._send(socket, events)
                    except Exception:  # never let the publisher die (the queue would grow unread)
                        log.exception("KV event batch not sent; the router will see a sequence gap")
        finally:
            socket.close()

    def _send(self, socket: Any, events: list[dict[str, Any]]) -> None:
        payload = msgpack.packb([time.time(), events, 0], use_bin_type=True)
        try:
            socket.send_multipart([self.topic, struct.pack(">Q", self.seq), payload])
        finally:
            self.seq += 1  # a batch that failed leaves a gap, which makes the router drop this worker's claims
        self.num_sent += len(events)

    def close(self, timeout: float = 2.0) -> None:
        self._queue.put(_STOP)
        self._thread.join(timeout)
        if self._thread.is_alive():
            self._context.destroy(linger=0)  # the thread is stuck in a send: drop what is left
        else:
            self._context.term()
