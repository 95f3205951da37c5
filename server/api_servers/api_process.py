"""An API process of several: the same FastAPI app as `diffbatch serve`, over an
`EngineClient` to the engine process (which also counts the API keys' limits and keeps the
result cache), serving on the socket its supervisor bound (the kernel hands each new
connection to one of the processes accepting on it)."""

from __future__ import annotations

import os
import signal
import socket
from multiprocessing.connection import Connection
from pathlib import Path

from engine.logs import configure_logging
from server.api_servers.client import EngineClient
from server.api_servers.key_limits_client import KeyLimitsClient
from server.api_servers.lifeline import watch_lifeline
from server.api_servers.result_cache_client import ResultCacheClient
from server.app import create_app
from server.composition import import_meanwhile
from server.listening import run_app
from server.ray_serve.gateways import GatewayHeader
from server.settings import ServeSettings

# Which API process answered (its index, 0 to N-1; a restarted one keeps its index), so a
# client's log and the server's can be joined to one process.
API_SERVER_HEADER = "x-diffbatch-api-server"


def api_main(
    settings: ServeSettings,
    sockets: list[socket.socket],
    path: Path,
    index: int,
    lifeline: Connection,
    *,
    run: str,
) -> None:
    """The process's target: serve HTTP on `sockets` until SIGTERM or the supervisor's end
    (`lifeline`): it drains as one server does. `run`: the supervisor's start, which every
    API process of it shares (`AppState.server_run`)."""
    configure_logging(settings.log_format, settings.log_level)
    watch_lifeline(lifeline, lambda: os.kill(os.getpid(), signal.SIGTERM))
    # The specs the engine process sends (a model's weightless pipeline, to admit requests
    # with) are of `pipelines/` classes, on torch and diffusers: about 8 s of imports on the
    # loaded 2-core machine. Unpickled by the first message that brings one, they would be
    # imported then, on the event loop, stalling every request and /health of this process
    # that long (a video POST past its client's timeout); imported now, beside the engine
    # process's own load, they are there before the first spec.
    import_meanwhile("pipelines.registry")
    client = EngineClient(path, tuple(entry.name for entry in settings.models))
    app = create_app(
        settings,
        client,
        engine_metrics=client.metrics_text,
        key_limits=KeyLimitsClient(client),
        result_cache=ResultCacheClient(client) if settings.result_cache_mb > 0 else None,
    )
    app.state.diffbatch.server_run = run
    app.add_middleware(GatewayHeader, gateway_id=str(index), name=API_SERVER_HEADER)
    run_app(app, settings, sockets=sockets)
