"""The app under uvicorn: its config from the settings, and the drain that begins as soon as
a shutdown signal arrives. Run by `diffbatch serve` in its one process, or by each API
process of several (`server.api_servers`) on the socket their supervisor bound."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable
from types import FrameType

import uvicorn
from fastapi import FastAPI
from uvicorn.config import LOGGING_CONFIG

from server.app import begin_drain
from server.settings import ServeSettings

# Health probes and metric scrapes come every few seconds and say nothing.
_QUIET_PATHS = ("/health", "/metrics")


def run_app(app: FastAPI, settings: ServeSettings, sockets: list[socket.socket] | None = None) -> None:
    """Serve `app` until a shutdown signal (or `app.state.request_shutdown()`), on `sockets`
    where given, else on the settings' host and port."""
    if settings.access_log == "quiet":
        logging.getLogger("uvicorn.access").addFilter(without_probes)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        # JSON: uvicorn's loggers propagate to the root's JSON handler (its own config would
        # give them text handlers of their own).
        log_config=None if settings.log_format == "json" else LOGGING_CONFIG,
        access_log=settings.access_log != "off",
        root_path=settings.root_path,
        ssl_certfile=settings.ssl_certfile,
        ssl_keyfile=settings.ssl_keyfile,
        # Past it, uvicorn cancels the requests still in flight; the engine then interrupts
        # the running forward at its next step, so shutdown is bounded.
        timeout_graceful_shutdown=settings.shutdown_timeout_s,
    )
    server = DrainingServer(config, on_exit=lambda: begin_drain(app))

    def request_shutdown() -> None:
        server.should_exit = True

    app.state.request_shutdown = request_shutdown
    # On SIGTERM or SIGINT uvicorn shuts down gracefully (the lifespan stops the engine and
    # its workers), then re-raises the signal: the process ends with the signal's status
    # (-15 / 143 for SIGTERM) and neither returns here nor runs exit handlers.
    server.run(sockets=sockets)


class DrainingServer(uvicorn.Server):
    """uvicorn's server, telling the app as soon as a shutdown signal arrives (uvicorn itself
    tells it only after requests in flight are done or cut off)."""

    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_exit = on_exit

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        with contextlib.suppress(RuntimeError):  # no loop yet: nothing in flight to drain
            # A signal handler may only hand work to the loop, not do it.
            asyncio.get_running_loop().call_soon_threadsafe(self._on_exit)


def without_probes(record: logging.LogRecord) -> bool:
    # uvicorn's access records carry (client, method, path, http version, status).
    args = record.args if isinstance(record.args, tuple) else ()
    path = str(args[2]).split("?", 1)[0] if len(args) > 2 else ""
    return path not in _QUIET_PATHS
