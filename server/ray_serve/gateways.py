"""Several gateways: when they may scale (every gateway must reach the same job rows and
output files, so a video made through one is polled and downloaded through another), and
the header that names the gateway that answered.

One gateway's state in its own files would be wrong with two: an SQLite job table is one
file on one node (two gateways there would fail each other's running jobs at start-up and
race on it; on two nodes each would see only its own jobs), and an output directory is
local to its node. So more than one needs PostgreSQL (`--database-url`) and a bucket
(`--output-url`); without them the application runs one gateway and logs why (the same
rule `diffbatch serve`'s single process never needs). A Serve config can still set the
gateway's `num_replicas` itself, past this rule: such a gateway refuses to start.
"""

from __future__ import annotations

import logging
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.settings import ServeSettings, SettingsError

logger = logging.getLogger(__name__)

# Which gateway replica answered (Serve's replica id): one gateway's log, metrics and
# answers can be told from another's.
GATEWAY_HEADER = "x-diffbatch-gateway"


def unshared_state(settings: ServeSettings) -> list[str]:
    """What keeps a second gateway from answering for the first; empty when none does."""
    missing = []
    if settings.database_url is None:
        missing.append(
            "video jobs and idempotency keys are in an SQLite file (set --database-url postgresql://...)"
        )
    if settings.output_url is None:
        missing.append("videos and url images are files in --output-dir (set --output-url s3://...)")
    return missing


def gateway_replicas(settings: ServeSettings) -> int:
    """`--gateway-replicas`, or 1 when the state is not shared (`warn_if_clamped` says why)."""
    return 1 if unshared_state(settings) else settings.gateway_replicas


def warn_if_clamped(settings: ServeSettings) -> None:
    missing = unshared_state(settings)
    if settings.gateway_replicas > 1 and missing:
        logger.warning(
            "--gateway-replicas %d: running 1 gateway, as several cannot share this state: %s",
            settings.gateway_replicas,
            "; ".join(missing),
        )


def check_shareable(settings: ServeSettings, world_size: int) -> None:
    """SettingsError for a gateway started as one of several (a Serve config's `num_replicas`
    for the Gateway deployment) over state that only one may hold."""
    missing = unshared_state(settings)
    if world_size > 1 and missing:
        raise SettingsError(
            f"the Gateway deployment runs {world_size} replicas, but several gateways cannot share "
            f"this state: {'; '.join(missing)}; give it num_replicas 1 or both settings"
        )


class GatewayHeader:
    """Adds `x-diffbatch-gateway: ID` (or the header `name`) to every HTTP answer (pure ASGI:
    streams pass through). The local API processes name themselves with it too."""

    def __init__(self, app: ASGIApp, gateway_id: str, name: str = GATEWAY_HEADER) -> None:
        self._app = app
        self._name = name.encode()
        self._value = gateway_id.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return

        async def named(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers: list[Any] = list(message.get("headers", ()))
                headers.append((self._name, self._value))
                message = {**message, "headers": headers}
            await send(message)

        await self._app(scope, receive, named)
