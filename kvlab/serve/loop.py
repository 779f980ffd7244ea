"""The engine loop: one thread owns the engine and steps it for every HTTP request at once.

The engine is not thread-safe, so nothing else touches it. Handlers on the asyncio side send typed commands
(`AddGroup`, `Abort`, `Call` a function such as `cache_state`, `Wake`) through a thread-safe inbox; the
thread applies them between steps, so an abort takes effect before the next step. Each step's outputs
go back to the handler's asyncio queue with `call_soon_threadsafe`. Continuous batching across HTTP
requests falls out of this: whatever was added before a step joins that step's batch.

The loop never dies from what a client sends: the engine's own KVLabErrors become 400s for the one
request that caused them. An unexpected exception inside `step()` fails only the request that causes it:
the requests in flight are suspended and rerun one by one, each alone in a step; one whose step fails again
is aborted (its blocks freed) and answered 500, the others carry on where they were.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from kvlab.errors import ContextLengthError, KVLabError
from kvlab.serve.metrics import ServerMetrics
from kvlab.serve.protocol import APIError, bad_request

log = logging.getLogger("kvlab.serve")

IDLE_WAIT_S = 0.5          # how long the idle loop blocks on the inbox before checking for shutdown
RETRY_AFTER_S = 1          # the Retry-After of a 429: the queue moves at engine-step speed


# --- what the asyncio side sends the loop thread (matched by type in EngineLoop._apply) -----------------
@dataclass(frozen=True)
class AddGroup:
    """Add a group's (request_id, prompt, params, cache_salt) requests, all or none; settle `done`."""

    group: "RequestGroup"
    requests: list[tuple[str, Any, Any, str | None]]
    aio: asyncio.AbstractEventLoop
    done: asyncio.Future
    arrival: float


@dataclass(frozen=True)
class Abort:
    """Abort these engine requests (those already finished are skipped)."""

    request_ids: list[str]


@dataclass(frozen=True)
class Call:
    """Run `fn(engine)` between steps; settle `done` with its result or its exception."""

    fn: Callable[[Any], Any]
    aio: asyncio.AbstractEventLoop
    done: asyncio.Future


@dataclass(frozen=True)
class Wake:
    """Nothing to apply: end the idle wait, so a stop, a drain or a pause is seen at once."""


Command = AddGroup | Abort | Call | Wake


class EngineFailure(Exception):
    """Delivered to a request's queue when the engine failed or the server shut down under it."""

    def __init__(self, error: APIError) -> None:
        super().__init__(error.message)
        self.error = error


@dataclass
class _Tracked:
    """What the loop thread knows about one engine request: where its outputs go, and its timings."""

    group: "RequestGroup"
    index: int
    arrival: float
    last_token_at: float = 0.0
    num_tokens: int = 0


@dataclass
class RequestGroup:
    """The engine requests behind one HTTP request (a completions batch has one per prompt).

    Outputs arrive on `queue` as `(index, RequestOutput)` (cumulative: each carries all tokens so far) or
    an `EngineFailure`. `abort()` is safe to call from any thread, any number of times.
    """

    loop: "EngineLoop"
    aio: asyncio.AbstractEventLoop
    request_ids: list[str]
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    finished: set[str] = field(default_factory=set)

    @property
    def done(self) -> bool:
        return len(self.finished) == len(self.request_ids)

    def abort(self) -> None:
        pending = [rid for rid in self.request_ids if rid not in self.finished]
        if pending:
            self.loop.abort(pending)

    async def updates(self):
        """Yield each batch of updates as it arrives: a dict index -> latest RequestOutput; ends when all are
        finished. Raises EngineFailure if the engine failed them."""
        while not self.done:
            batch = [await self.queue.get()]
            while not self.queue.empty():
                batch.append(self.queue.get_nowait())
            latest = {}
            for item in batch:
                if isinstance(item, EngineFailure):
                    raise item
                index, output = item
                latest[index] = output
                if output.finished:
                    self.finished.add(output.request_id)
            yield latest


class EngineLoop:
    """Owns `engine`; `start()` runs the loop thread, `stop()` ends it (in-flight requests get 503)."""

    def __init__(self, engine: Any, metrics: ServerMetrics, max_waiting: int = 256) -> None:
        self.engine = engine
        self.metrics = metrics
        self.max_waiting = max_waiting
        self._inbox: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._tracked: dict[str, _Tracked] = {}     # loop thread only
        self._lock = threading.Lock()
        self._pending_adds = 0                      # requests sent but not yet added (under _lock)
        self._draining = False
        self._drain_deadline: float | None = None
        self._paused = False                        # POST /pause: no steps until /resume (loop thread reads)
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self.stats: dict[str, Any] = dict(engine.stats())   # snapshot, replaced after every step

    # --- the asyncio side ------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvlab-engine-loop", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        self._inbox.put(Wake())
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping.is_set()

    def begin_shutdown(self, grace_s: float) -> None:
        """Refuse new work (503); let requests in flight finish for `grace_s`, then abort them."""
        with self._lock:
            self._draining = True
            self._drain_deadline = time.monotonic() + grace_s
        self._inbox.put(Wake())

    def set_paused(self, paused: bool) -> None:
        """Stop stepping (requests in flight keep their blocks and wait) or start again, as vLLM's and
        SGLang's pause/resume do: between steps, so a paused engine holds whole steps only."""
        self._paused = paused
        self._inbox.put(Wake())

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def num_waiting(self) -> int:
        return self._pending_adds + int(self.stats.get("num_waiting", 0))

    async def add(self, requests: list[tuple[str, Any, Any, str | None]]) -> RequestGroup:
        """Add (request_id, prompt, params, cache_salt) requests together: all are added or none is.

        Raises APIError: 503 while shutting down, 429 when the waiting queue is full, 400 when the engine
        refuses a request (the engine is then left as it was).
        """
        aio = asyncio.get_running_loop()
        group = RequestGroup(self, aio, [r[0] for r in requests])
        if len(requests) > self.max_waiting:   # 429 would be a lie: this can never be admitted
            raise bad_request(f"{len(requests)} prompts in one request can never be admitted: the waiting "
                              f"queue holds {self.max_waiting} (--max-waiting)", "prompt", "too_many_prompts")
        with self._lock:
            if self._draining or self._stopping.is_set():
                raise APIError(503, "the server is shutting down", "service_unavailable")
            if self.num_waiting + len(requests) > self.max_waiting:
                raise APIError(429, f"too many requests waiting (the queue holds {self.max_waiting}); retry "
                               "later", "rate_limit_error", code="queue_full",
                               headers={"Retry-After": str(RETRY_AFTER_S)})
            self._pending_adds += len(requests)
        done = aio.create_future()
        self._inbox.put(AddGroup(group, requests, aio, done, time.monotonic()))
        try:
            await done
        except asyncio.CancelledError:   # the handler was cancelled (client gone) while the add was queued
            self.abort(group.request_ids)
            raise
        return group

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """Run `fn(engine)` on the loop thread between steps and return its result."""
        aio = asyncio.get_running_loop()
        done = aio.create_future()
        self._inbox.put(Call(fn, aio, done))
        return await done

    def abort(self, request_ids: list[str]) -> None:
        self._inbox.put(Abort(list(request_ids)))

    # --- the loop thread -------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                self._iterate()
            except Exception:  # never let the loop die; _iterate already failed what it could
                log.exception("engine loop iteration failed")
                time.sleep(0.05)
        self._fail_all(APIError(503, "the server shut down before the request finished",
                                "service_unavailable"))

    def _iterate(self) -> None:
        busy = self.engine.has_unfinished_requests() and not self._paused
        try:
            command = self._inbox.get_nowait() if busy else self._inbox.get(timeout=IDLE_WAIT_S)
        except queue.Empty:
            command = None
        while command is not None:
            self._apply(command)
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                command = None
        if self._draining and self._drain_deadline is not None and time.monotonic() >= self._drain_deadline:
            self._fail_all(APIError(503, "the server is shutting down", "service_unavailable"))
        if self.engine.has_unfinished_requests() and not self._paused:
            try:
                outputs = self.engine.step()
            except Exception:
                log.exception("engine.step() failed; rerunning the requests in flight one by one")
                outputs = self._isolate_failure()
            self._dispatch(outputs)
        self.stats = dict(self.engine.stats())

    def _isolate_failure(self) -> list:
        """After a failed step: suspend every request in flight, then give each a step of its own. A
        request whose own step fails is the culprit: its group is failed with a 500 and its blocks freed.
        The others resume where they were (a suspended request is recomputed like a preempted one, so
        its tokens are the same). When no request fails alone, all resume: the fault was not theirs."""
        error = APIError(500, "the engine failed while running this request", "internal_server_error")
        suspended = []
        for rid in list(self._tracked):
            try:
                self.engine.suspend_request(rid)
                suspended.append(rid)
            except KVLabError:   # it finished inside the failed step, and its output went with it
                self._fail_group(self._tracked[rid].group, error)
        outputs, culprits = [], 0
        try:
            for rid in suspended:
                if rid not in self._tracked:
                    continue   # failed with its group already
                self.engine.resume_request(rid)
                try:
                    outputs.extend(self.engine.step())
                except Exception:
                    log.exception("request %s fails the engine step on its own: failing it", rid)
                    culprits += 1
                    self._fail_group(self._tracked[rid].group, error)
                    continue
                try:
                    self.engine.suspend_request(rid)
                except KVLabError:
                    pass   # it finished in its own step
        finally:
            for rid in suspended:
                self.engine.resume_request(rid)   # a no-op for the failed and the finished
        if not culprits:
            log.warning("no request fails a step on its own; all %d carry on", len(suspended))
        return outputs

    def _apply(self, command: Command) -> None:
        match command:
            case AddGroup(group, requests, aio, done, arrival):
                with self._lock:
                    self._pending_adds -= len(requests)
                error = self._add_group(group, requests, arrival)
                _resolve(aio, done, None, error)
            case Abort(request_ids):
                for rid in request_ids:
                    if rid in self._tracked:
                        self._abort_quietly(rid)
            case Call(fn, aio, done):
                try:
                    result, error = fn(self.engine), None
                except Exception as exc:  # a bad call must not end the loop
                    log.exception("engine call failed")
                    result, error = None, exc
                _resolve(aio, done, result, error)
            case Wake():
                pass

    def _add_group(self, group: RequestGroup, requests: list, arrival: float) -> Exception | None:
        if self._draining:
            return APIError(503, "the server is shutting down", "service_unavailable")
        added: list[str] = []
        for index, (rid, prompt, params, salt) in enumerate(requests):
            try:
                self.engine.add_request(rid, prompt, params, cache_salt=salt)
            except Exception as exc:
                for done_rid in added:
                    self._abort_quietly(done_rid)
                if isinstance(exc, KVLabError):
                    return bad_request(str(exc), code=_error_code(exc))
                log.exception("engine.add_request failed")
                return APIError(500, f"the engine could not add the request: {exc}", "internal_server_error")
            added.append(rid)
            self._tracked[rid] = _Tracked(group, index, arrival)
        return None

    def _abort_quietly(self, rid: str) -> None:
        """Abort in the engine; the aborted output that the next step returns is dropped."""
        tracked = self._tracked.pop(rid, None)
        try:
            self.engine.abort_request(rid)
        except KVLabError:
            pass  # it finished in the step that just ran
        if tracked is not None:
            self.metrics.request_finished("abort")

    def _dispatch(self, outputs: list) -> None:
        now = time.monotonic()
        for output in outputs:
            tracked = self._tracked.get(output.request_id)
            if tracked is None:
                continue   # aborted by us: its client is gone
            num_tokens = sum(len(c.token_ids) for c in output.outputs)
            if num_tokens > tracked.num_tokens:
                if tracked.num_tokens == 0:
                    self.metrics.ttft.observe(now - tracked.arrival)
                else:
                    self.metrics.itl.observe(now - tracked.last_token_at)
                tracked.num_tokens, tracked.last_token_at = num_tokens, now
            if output.finished:
                del self._tracked[output.request_id]
                reasons = {c.finish_reason for c in output.outputs}
                self.metrics.request_finished("length" if reasons == {"length"} else
                                              "abort" if "abort" in reasons else "stop")
            group = tracked.group
            _post(group, (tracked.index, output))

    def _fail_group(self, group: RequestGroup, error: APIError) -> None:
        for rid in [r for r, t in self._tracked.items() if t.group is group]:
            self._abort_quietly(rid)
        _post(group, EngineFailure(error))

    def _fail_all(self, error: APIError) -> None:
        failure = EngineFailure(error)
        groups = {}
        for rid in list(self._tracked):
            groups[id(self._tracked[rid].group)] = self._tracked[rid].group
            self._abort_quietly(rid)
        for group in groups.values():
            _post(group, failure)


def _post(group: RequestGroup, item: Any) -> None:
    try:
        group.aio.call_soon_threadsafe(group.queue.put_nowait, item)
    except RuntimeError:
        pass  # the event loop is closed (shutdown)


def _resolve(aio: asyncio.AbstractEventLoop, future: asyncio.Future, result: Any,
             error: Exception | None) -> None:
    def settle() -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    try:
        aio.call_soon_threadsafe(settle)
    except RuntimeError:
        pass


def _error_code(exc: Exception) -> str | None:
    return "context_length_exceeded" if isinstance(exc, ContextLengthError) else None
