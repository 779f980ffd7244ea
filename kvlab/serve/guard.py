"""What a request must be before any handler sees it: addressed to an allowed Host, and, for a POST, a JSON
body no larger than `max_request_bytes`.

Why a Host allow-list: with no API key (the default) any web page can make the browser send requests to
127.0.0.1 through a name it controls (DNS rebinding) and read the answers, such as /v1/cache/state. A
rebinding page's requests carry its own name in `Host`, so only loopback names, IP literals (a rebinding
needs a name), the bound host and `--allowed-hosts` are served, as Vite and Jupyter do. Why JSON only: a
cross-site HTML form can POST urlencoded, multipart or text/plain bodies without a CORS preflight, never
application/json. Why the size check here: the body is counted while it is read, before anything parses
it, so a 10 MB body costs 10 MB of reading and nothing else (a 413 as soon as the limit is passed, or
at once when Content-Length says so).
"""

from __future__ import annotations

import ipaddress
from typing import Iterable

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvlab.serve.limits import DEFAULT_MAX_REQUEST_BYTES
from kvlab.serve.protocol import APIError

LOOPBACK_NAMES = ("localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback")


def host_name(host_header: str) -> str:
    """The name in a Host header, without port, brackets, trailing dot or case."""
    host = host_header.strip().lower()
    if host.startswith("["):
        host = host[1:host.find("]")] if "]" in host else host[1:]
    elif host.count(":") == 1:
        host = host.rsplit(":", 1)[0]
    return host.rstrip(".")


def host_allowed(host_header: str | None, allowed: Iterable[str]) -> bool:
    """Loopback names, IP literals, and `allowed` entries ("*" = any; ".example.com" = it and subdomains)."""
    if host_header is None:
        return True   # HTTP/1.0 without Host: no browser sends that
    host = host_name(host_header)
    if host in LOOPBACK_NAMES or host.endswith(".localhost"):
        return True
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        pass
    for entry in allowed:
        entry = entry.strip().lower().rstrip(".")
        if entry == "*" or entry == host or (entry.startswith(".") and (host == entry[1:] or host.endswith(entry))):
            return True
    return False


class RequestGuard:
    """403 for a Host not allowed, 415 for a POST that is not JSON, 413 for a body over the limit; all in
    OpenAI's error shape, before routing."""

    def __init__(self, app: ASGIApp, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
                 allowed_hosts: Iterable[str] = ()) -> None:
        self.app = app
        self.max_request_bytes = int(max_request_bytes)
        self.allowed_hosts = tuple(allowed_hosts)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        if not host_allowed(headers.get("host"), self.allowed_hosts):
            await _refuse(APIError(403, f"the Host {host_name(headers['host'])!r} is not allowed: start the "
                                   "server with --allowed-hosts NAME to serve it", "permission_error",
                                   "host", "host_not_allowed"), scope, receive, send)
            return
        if scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        media = headers.get("content-type", "").split(";")[0].strip().lower()
        if media != "application/json":
            await _refuse(APIError(415, "a POST body must be JSON (Content-Type: application/json), got "
                                   f"{media or 'no content type'}", code="unsupported_media_type"),
                          scope, receive, send)
            return
        too_large = APIError(413, f"the request body is larger than {self.max_request_bytes} bytes "
                             "(--max-request-bytes)", code="request_too_large")
        length = headers.get("content-length")
        if length is not None and (not length.strip().isdigit() or int(length) > self.max_request_bytes):
            await _refuse(too_large, scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return   # the client left before sending its body
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_request_bytes:
                await _refuse(too_large, scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replay: list[Message] = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def receive_again() -> Message:   # the body once, then the client's own messages (disconnect)
            return replay.pop() if replay else await receive()

        await self.app(scope, receive_again, send)


async def _refuse(error: APIError, scope: Scope, receive: Receive, send: Send) -> None:
    await JSONResponse(error.body(), status_code=error.status, headers=error.headers)(scope, receive, send)
