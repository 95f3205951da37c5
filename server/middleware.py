"""Pure ASGI middleware: request metrics and the request body size limit.

Pure ASGI (not BaseHTTPMiddleware) so streaming responses and client disconnects pass
through untouched.
"""

from __future__ import annotations

import re
import time
import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.errors import APIError, error_response
from server.metrics import Metrics


class BodyTooLargeError(APIError):
    def __init__(self, limit: int) -> None:
        super().__init__(
            413, f"the request body exceeds this server's limit of {limit} bytes", code="request_too_large"
        )


class BodyLimitMiddleware:
    """Refuse bodies over `max_bytes`: by Content-Length at once, else while reading them
    (chunked uploads): the 413 is sent from here, the app then sees the client gone and
    anything it still tries to send is dropped. (Raising inside `receive` instead would reach
    the app's body parser, which reports any failure as a 400.)"""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                await error_response(BodyTooLargeError(self.max_bytes))(scope, receive, send)
                return
        received = 0
        refused = False
        started = False

        async def limited_receive() -> Message:
            nonlocal received, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    refused = True
                    if not started:
                        await error_response(BodyTooLargeError(self.max_bytes))(scope, receive, send)
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if refused:
                return  # the 413 is the answer
            started = started or message["type"] == "http.response.start"
            await send(message)

        await self.app(scope, limited_receive, guarded_send)


# A client's X-Request-Id is used as the request's id when it looks like one.
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")


class RequestIdMiddleware:
    """Every request gets an id: the client's `X-Request-Id` (so its logs and ours can be
    joined) or a fresh one. It is echoed in the response and is the engine's request id,
    which every log line about the request names; a second request sent with an id still
    in progress is refused (409) rather than run twice."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"x-request-id"), "")
        request_id = given if _REQUEST_ID.match(given) else f"req-{uuid.uuid4().hex}"
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], (b"x-request-id", request_id.encode())]
            await send(message)

        await self.app(scope, receive, send_with_id)


class MetricsMiddleware:
    """Count every HTTP request by route template and status, and time it."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def recording_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, recording_send)
        finally:
            route = scope.get("route")
            # The route template, never the raw path, so metric labels stay few.
            endpoint = getattr(route, "path", None) or _mount_prefix(scope) or "unmatched"
            self.metrics.requests.labels(endpoint=endpoint, status=str(status)).inc()
            self.metrics.request_latency.labels(endpoint=endpoint).observe(time.perf_counter() - start)


def _mount_prefix(scope: Scope) -> str:
    """The prefix of the mount that answered (the playground's files): a mount sets no route,
    only a root path longer than the one it was given."""
    outer = scope.get("app_root_path")
    root: str = scope.get("root_path", "")
    return root[len(outer) :] if isinstance(outer, str) and root.startswith(outer) else ""
