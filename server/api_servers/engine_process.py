"""The engine process of several API processes: the engine `diffbatch serve` would hold
(`build_engine`: one model's `AsyncEngine` or a `ModelSet`, with its worker processes), its
metrics and its engine spans, served to the API processes by an `EngineHost`, with what they
count and keep once for the whole server: the API keys' limits and the result cache.

It listens before its model loads, so the API processes answer `/health` ("starting") at
once; it tells the supervisor when the engine has started (from then on, a death of this
process is restarted, where a model that cannot load stops the server, as in one process).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path

from prometheus_client import generate_latest

from engine.logs import configure_logging
from server.api_servers.host import EngineHost
from server.api_servers.lifeline import watch_lifeline
from server.app import build_engine, refused_flag
from server.key_limits import KeyLimits, KeyLimitsCollector
from server.metrics import Metrics
from server.result_cache import result_cache_for
from server.settings import ServeSettings
from server.tracing.start import start_tracing

logger = logging.getLogger(__name__)

# Exit statuses the supervisor reads: the model could not load (a refused setting: 2).
LOAD_FAILED = 1
SETTING_REFUSED = 2
# With the supervisor gone, beyond the API processes' drain, how long they may take to go.
ORPHAN_MARGIN_S = 10.0


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
    key_limits = KeyLimits(settings.api_key_entries)
    metrics.watch(KeyLimitsCollector(key_limits))  # its live text reaches every API process
    result_cache = result_cache_for(settings.result_cache_mb)
    if result_cache is not None:
        metrics.watch_result_cache(result_cache)
    host = EngineHost(engine, lambda: generate_latest(metrics.live), key_limits, result_cache)
    await host.listen(path)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    orphaned: list[asyncio.Task[None]] = []  # kept: the loop holds tasks weakly

    def once_alone() -> None:
        limit_s = settings.shutdown_timeout_s + ORPHAN_MARGIN_S
        orphaned.append(loop.create_task(_stop_once_alone(host, stop, limit_s)))

    watch_lifeline(
        lifeline,
        lambda: loop.call_soon_threadsafe(stop.set),
        lambda: loop.call_soon_threadsafe(once_alone),
    )
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
    if say_started(lifeline):
        logger.info("engine process serving %s", settings.model if not several else "several models")
    await stop.wait()  # set once the API processes have drained, where the supervisor is gone
    await engine.stop()
    await host.close()
    await asyncio.to_thread(tracing.shutdown)
    logger.info("engine stopped")
    return 0


def say_started(lifeline: Connection) -> bool:
    """Tell the supervisor the engine has started; False where it is gone (it died while the
    model loaded): the lifeline's watcher has heard it too and stops this process once the
    API processes have drained, so that is a line in the log, not a traceback."""
    try:
        lifeline.send("started")
    except OSError as exc:  # BrokenPipeError, or a pipe already closed
        logger.warning("the supervisor went away while the engine was loading (%s); stopping", exc)
        return False
    return True


async def _stop_once_alone(host: EngineHost, stop: asyncio.Event, limit_s: float) -> None:
    """The supervisor died (SIGKILL) without saying stop: the API processes see it too and
    drain as on SIGTERM, so the engine stops once they are gone (or after `limit_s`), as the
    supervisor would have stopped it, last: their requests in flight finish meanwhile."""
    logger.warning("the supervisor is gone; stopping once the API processes have drained")
    deadline = time.monotonic() + limit_s
    while host.connections and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    stop.set()
