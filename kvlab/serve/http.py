"""ASGI plumbing: API-key checks, and noticing a client that went away so its engine requests stop.

Why not rely on the SSE generator's `finally`: when a client disconnects, Starlette may leave the
generator suspended until garbage collection, and a non-streaming handler has no generator at all. So the
streaming response aborts its requests in its own teardown, and non-streaming handlers race the result
against the client's `http.disconnect` message.
"""

from __future__ import annotations

import asyncio
import secrets
from typing import Any, Awaitable

from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from kvlab.serve.protocol import APIError

OPEN_PATHS = ("/health", "/metrics", "/", "/favicon.ico")   # stay open with a key set, as in vLLM
OPEN_PREFIXES = ("/static/",)


class APIKeyMiddleware:
    """401 for every API route without `Authorization: Bearer KEY`; health, metrics and the page stay open.
    The scheme is matched case-insensitively (RFC 9110: `bearer KEY` is the same), the key exactly and in
    constant time."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("method") != "OPTIONS" and not _is_open(scope["path"]):
            scheme, _, given = dict(scope["headers"]).get(b"authorization", b"").strip().partition(b" ")
            if not (secrets.compare_digest(given.strip(), self.expected) & (scheme.lower() == b"bearer")):
                error = APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                                 "authentication_error", code="invalid_api_key")
                await JSONResponse(error.body(), status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _is_open(path: str) -> bool:
    return path in OPEN_PATHS or path.startswith(OPEN_PREFIXES)


async def wait_for_disconnect(request: Request) -> None:
    """Return when the client closes the connection (the body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Awaitable[Any]) -> tuple[bool, Any]:
    """Run `work` until it finishes or the client disconnects: (finished, result)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return True, task.result()
        return False, None
    finally:
        for t in (task, gone):
            t.cancel()
        await asyncio.gather(task, gone, return_exceptions=True)


class AbortingStreamingResponse(StreamingResponse):
    """Server-sent events whose teardown calls `on_close` however the stream ends (done, error, client
    gone), so the engine requests behind it are aborted within one step of a disconnect."""

    def __init__(self, content: Any, on_close: Any) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stream = asyncio.ensure_future(self.stream_response(send))
        gone = asyncio.ensure_future(self.listen_for_disconnect(receive))
        try:
            await asyncio.wait({stream, gone}, return_when=asyncio.FIRST_COMPLETED)
            if stream.done() and not stream.cancelled() and isinstance(stream.exception(), Exception):
                if not isinstance(stream.exception(), OSError):   # OSError: the client went away
                    raise stream.exception()
        finally:
            self.on_close()
            for t in (stream, gone):
                t.cancel()
            await asyncio.gather(stream, gone, return_exceptions=True)
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()
