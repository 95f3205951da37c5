"""The engine process of several API processes: the engine `diffbatch serve` would hold
(`build_engine`: one model's `AsyncEngine` or a `ModelSet`, with its worker processes), its
metrics and its engine spans, served to the API processes by an `EngineHost`.

It listens before its model loads, so the API processes answer `/health` ("starting") at
once; it tells the supervisor when the engine has started (from then on, a death of this
process is restarted, where a model that cannot load stops the server, as in one process).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from multiprocessing.connection import Connection
from pathlib import Path

from prometheus_client import generate_latest

from engine.logs import configure_logging
from server.api_servers.host import EngineHost
from server.api_servers.lifeline import watch_lifeline
from server.app import build_engine, refused_flag
from server.metrics import Metrics
from server.settings import ServeSettings
from server.tracing.start import start_tracing

logger = logging.getLogger(__name__)

# Exit statuses the supervisor reads: the model could not load (a refused setting: 2).
LOAD_FAILED = 1
SETTING_REFUSED = 2


def engine_main(settings: ServeSettings, path: Path, lifeline: Connection) -> None:
    """The process's target: serve the engine on the Unix socket `path` until the supervisor
    says stop on `lifeline` (or dies); "started" is said on it once the engine has started."""
    configure_logging(settings.log_format, settings.log_level)
    # A signal to the whole group (Ctrl-C, systemd's stop) reaches this process too: it is
    # the supervisor that stops it, last, once the API processes have drained.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sys.exit(asyncio.run(_serve(settings, path, lifeline)))


async def _serve(settings: ServeSettings, path: Path, lifeline: Connection) -> int:
    engine = build_engine(settings)
    metrics = Metrics()
    tracing = start_tracing(settings)
    spans = tracing.engine_observer()
    if spans is not None:
        engine.observers.append(spans)
    host = EngineHost(engine, lambda: generate_latest(metrics.live))
    await host.listen(path)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    watch_lifeline(lifeline, lambda: loop.call_soon_threadsafe(stop.set))
    several = engine.model_set_status() is not None
    if several:  # bound first: the preloads' states show in /metrics as they happen
        metrics.bind(engine)
    try:
        await engine.start()
    except Exception as exc:
        if refused_flag(exc) is not None:  # one line, as `diffbatch serve` says it
            print(f"diffbatch: {exc}", file=sys.stderr)
            return SETTING_REFUSED
        logger.exception("could not load model %s; stopping the server", settings.model)
        return LOAD_FAILED
    if not several:
        metrics.bind(engine)
    lifeline.send("started")
    logger.info("engine process serving %s", settings.model if not several else "several models")
    await stop.wait()
    await engine.stop()
    await host.close()
    await asyncio.to_thread(tracing.shutdown)
    logger.info("engine stopped")
    return 0
