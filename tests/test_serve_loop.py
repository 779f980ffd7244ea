"""The engine loop's typed commands (AddGroup, Abort, Call, Wake), applied on the test's own thread: the loop
thread is never started, so each command is sent by the asyncio side and applied by one `_iterate()`, with
no thread or clock to race. A recording stand-in engine shows what reached it."""

from __future__ import annotations

import asyncio

import pytest

from kvlab.errors import InputError
from kvlab.serve.loop import Abort, EngineLoop, Wake
from kvlab.serve.metrics import ServerMetrics
from kvlab.serve.protocol import APIError


class RecordingEngine:
    """Accepts any prompt but "bad" (an InputError, as the engine refuses a request); never has work."""

    def __init__(self) -> None:
        self.added: list[tuple[str, object, object, str | None]] = []
        self.aborted: list[str] = []

    def stats(self) -> dict:
        return {"num_waiting": len(self.added) - len(self.aborted)}

    def has_unfinished_requests(self) -> bool:
        return False

    def add_request(self, rid: str, prompt: object, params: object, cache_salt: str | None = None) -> None:
        if prompt == "bad":
            raise InputError("prompt 'bad' is refused")
        self.added.append((rid, prompt, params, cache_salt))

    def abort_request(self, rid: str) -> None:
        self.aborted.append(rid)


def sent_and_applied(loop: EngineLoop, send):
    """Send one command from the asyncio side, apply the inbox once on this thread, return the result."""
    async def go():
        task = asyncio.ensure_future(send())
        while loop._inbox.empty():
            await asyncio.sleep(0)   # let the task put its command
        loop._iterate()
        return await task
    return asyncio.run(go())


@pytest.fixture
def loop() -> EngineLoop:
    return EngineLoop(RecordingEngine(), ServerMetrics("m"))


def test_add_group_reaches_the_engine_and_is_tracked(loop):
    group = sent_and_applied(loop, lambda: loop.add([("a", [1, 2], "p", None), ("b", "text", "q", "salt")]))
    assert loop.engine.added == [("a", [1, 2], "p", None), ("b", "text", "q", "salt")]
    assert group.request_ids == ["a", "b"] and sorted(loop._tracked) == ["a", "b"]
    assert loop._pending_adds == 0


def test_a_refused_add_is_a_400_and_leaves_none_of_its_group(loop):
    with pytest.raises(APIError) as info:
        sent_and_applied(loop, lambda: loop.add([("a", [1], "p", None), ("b", "bad", "p", None)]))
    assert info.value.status == 400 and "'bad' is refused" in info.value.message
    assert loop.engine.aborted == ["a"] and loop._tracked == {} and loop._pending_adds == 0


def test_abort_aborts_tracked_requests_and_skips_unknown_ones(loop):
    sent_and_applied(loop, lambda: loop.add([("a", [1], "p", None), ("b", [2], "p", None)]))
    loop.abort(["b", "gone"])
    assert isinstance(loop._inbox.get_nowait(), Abort)
    loop._apply(Abort(["b", "gone"]))
    assert loop.engine.aborted == ["b"] and list(loop._tracked) == ["a"]


def test_call_returns_its_result_or_raises_its_error_and_the_loop_carries_on(loop):
    assert sent_and_applied(loop, lambda: loop.call(lambda engine: engine.stats())) == {"num_waiting": 0}

    def broken(engine):
        raise ValueError("no such thing")
    with pytest.raises(ValueError, match="no such thing"):
        sent_and_applied(loop, lambda: loop.call(broken))
    assert sent_and_applied(loop, lambda: loop.call(lambda engine: 7)) == 7


def test_stop_drain_and_pause_send_a_wake_that_changes_nothing(loop):
    loop.set_paused(True)
    loop.begin_shutdown(5.0)
    loop.stop()
    sent = [loop._inbox.get_nowait() for _ in range(3)]
    assert sent == [Wake(), Wake(), Wake()] and loop._inbox.empty()
    for command in sent:
        loop._apply(command)
    assert loop.engine.added == [] and loop.engine.aborted == [] and loop._tracked == {}


def test_commands_are_typed_values():
    """Each message is a frozen dataclass matched by type: two equal commands compare equal."""
    assert Abort(["x"]) == Abort(["x"]) and Abort(["x"]) != Abort(["y"])
    with pytest.raises(AttributeError):
        Abort(["x"]).request_ids = []   # frozen
