"""Requests a browser was tricked into sending: foreign hosts and foreign origins.

A server on localhost without an API key is reachable from any web page the user opens:
- by **DNS rebinding**, a page's own host name is pointed at 127.0.0.1, so its scripts
  talk to this server with a `Host` header naming their site. `allowed_hosts` refuses
  such requests (400). The default, on a loopback bind without a key, is the loopback
  names only.
- by a **cross-site request** (a form or `fetch` with a "simple" content type, which
  needs no CORS preflight): the browser sends an `Origin` naming the other site. Without
  an API key such requests are refused (403) unless their origin is this server's own
  host; with a key they cannot carry it (no CORS is offered), so they fail at the key.

With `--allowed-origins`, pages on those origins may call the API (CORS), with the headers
the official clients send; a refused preflight is an OpenAI error object.

`public_base_url` decides the host of the links this server hands out
(`response_format=url`): `--public-url`, or the request's host when it is one the
operator named, never a host the client chose freely.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from server.errors import APIError, error_response

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def default_allowed_hosts(bind_host: str, has_api_key: bool) -> list[str]:
    """Loopback names when bound to loopback without a key (the DNS-rebinding case); any
    host otherwise (a public bind is reached by names the server cannot know)."""
    if not has_api_key and bind_host in LOOPBACK_HOSTS:
        return list(LOOPBACK_HOSTS)
    return ["*"]


def host_allowed(host: str, allowed: list[str]) -> bool:
    """`host` (no port) matches a name, a `*.domain` pattern, or `*`."""
    host = host.lower()
    for name in (pattern.lower() for pattern in allowed):
        if name in ("*", host) or (name.startswith("*.") and host.endswith(name[1:])):
            return True
    return False


def _host_of(authority: str) -> str:
    """The host of a `Host` header or URL authority, without port or IPv6 brackets ("" if
    it cannot be read, which no allowed-host list matches except `*`)."""
    try:
        return urlsplit(f"//{authority}").hostname or ""
    except ValueError:  # a malformed authority such as "[::1"
        return ""


class CrossSiteMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        allowed_hosts: list[str],
        has_api_key: bool,
        allowed_origins: list[str] | None = None,
    ) -> None:
        self.app = app
        self.allowed_hosts = allowed_hosts
        self.has_api_key = has_api_key
        # Origins the operator opened to browsers (--allowed-origins).
        self.allowed_origins = allowed_origins or []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {name.decode("latin-1"): value.decode("latin-1") for name, value in scope["headers"]}
        host = _host_of(headers.get("host", ""))
        if not host_allowed(host, self.allowed_hosts):
            error = APIError(
                400,
                f"host {host!r} is not allowed by this server (--allowed-hosts)",
                code="host_not_allowed",
            )
            await error_response(error)(scope, receive, send)
            return
        origin = headers.get("origin")
        opened = "*" in self.allowed_origins or (origin or "").rstrip("/") in self.allowed_origins
        if origin and not self.has_api_key and not opened and _host_of(urlsplit(origin).netloc) != host:
            error = APIError(
                403,
                f"cross-origin requests from {origin!r} are refused by a server without an API key",
                code="cross_origin",
            )
            await error_response(error)(scope, receive, send)
            return
        await self.app(scope, receive, send)


# Request headers a page on an allowed origin may send: the key, the body's type, its own
# request id, and what the official OpenAI clients add (`x-stainless-*` by prefix: each
# release adds some; User-Agent, which Firefox lets scripts set).
CORS_REQUEST_HEADERS = frozenset(
    {
        "accept",
        "authorization",
        "content-type",
        "idempotency-key",
        "openai-beta",
        "openai-organization",
        "openai-project",
        "user-agent",
        "x-request-id",
    }
)
CORS_HEADER_PREFIX = "x-stainless-"
# Response headers its scripts may read: the request id, and what the clients' retries and
# polling follow.
CORS_EXPOSED_HEADERS = ("x-request-id", "retry-after", "x-should-retry", "openai-poll-after-ms")
CORS_METHODS = ("GET", "POST", "DELETE")


class BrowserCORSMiddleware(CORSMiddleware):
    """Starlette's CORS for `--allowed-origins`, allowing the headers the official clients
    send (a prefix, which Starlette's list of names cannot say: it is told "*" and the
    names are checked here) and answering a refused preflight as an OpenAI error."""

    def __init__(self, app: ASGIApp, allow_origins: list[str]) -> None:
        super().__init__(
            app,
            allow_origins=allow_origins,
            allow_methods=CORS_METHODS,
            allow_headers=["*"],  # echoes the requested names once `preflight_response` allows them
            expose_headers=CORS_EXPOSED_HEADERS,
            # The operator opened the server to these origins, also from a public page to a
            # server on a private network (Chrome's Private Network Access preflight).
            allow_private_network=True,
        )

    def preflight_response(self, request_headers: Headers) -> Response:
        origin = request_headers["origin"]
        method = request_headers["access-control-request-method"]
        requested = request_headers.get("access-control-request-headers", "")
        names = [name.strip().lower() for name in requested.split(",") if name.strip()]
        refused = [n for n in names if n not in CORS_REQUEST_HEADERS and not n.startswith(CORS_HEADER_PREFIX)]
        reasons = []
        if not self.is_allowed_origin(origin):
            reasons.append(f"origin {_clip(origin)!r} is not one of --allowed-origins")
        if method not in self.allow_methods:
            reasons.append(f"method {_clip(method)!r} is not one of {', '.join(CORS_METHODS)}")
        if refused:
            reasons.append(f"headers {_clip(', '.join(refused))!r} are not among those allowed")
        response = super().preflight_response(request_headers)
        if not reasons and response.status_code == 200:
            return response
        detail = "; ".join(reasons) or bytes(response.body).decode("latin-1")
        return error_response(APIError(400, f"CORS preflight refused: {detail}", code="cors_refused"))


def _clip(text: str, limit: int = 200) -> str:
    """A client's value, shortened for a message."""
    return text if len(text) <= limit else text[:limit] + "..."


def public_base_url(request: Request, public_url: str | None, allowed_hosts: list[str]) -> str:
    """Where this server is reached, for the links it hands out, ending in '/'."""
    if public_url:
        return public_url.rstrip("/") + "/"
    if "*" not in allowed_hosts:
        # The Host header is one the operator named (the middleware checked it).
        return str(request.base_url)
    # Any host is accepted, so the client's is not trusted: the address it connected to.
    server = request.scope.get("server") or ("127.0.0.1", 80)
    address = f"[{server[0]}]" if ":" in str(server[0]) else str(server[0])
    root = request.scope.get("root_path", "").rstrip("/")
    return f"{request.url.scheme}://{address}:{server[1]}{root}/"
