"""`serve_api_servers`: `diffbatch serve --api-server-count N`. The supervisor binds the
port once and starts the engine process and N API processes (spawned: none inherits this
process's threads), the API processes all accepting on the one socket, as uvicorn's own
workers do, so a client sees one port.

It restarts what dies: an API process (its requests end with its connections; the engine
process aborts what it had sent), or the engine process once it has served (every request in
flight ends with 503 `engine_restarting`; the API processes reconnect by themselves). An
engine process that could not load its model stops the server, as one process does. On
SIGTERM or SIGINT the API processes drain first (`--shutdown-timeout-s`), then the engine
stops, then this process ends with the signal's status, as `diffbatch serve` does.

Its private directory (mode 0700) holds the engine's Unix socket and the metrics files of
prometheus-client's multiprocess mode (`server.metrics`), removed at exit.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import socket
import tempfile
import time
from multiprocessing.connection import Connection, wait
from multiprocessing.context import SpawnProcess
from pathlib import Path
from types import FrameType

from server.api_servers.api_process import api_main
from server.api_servers.engine_process import LOAD_FAILED, SETTING_REFUSED, engine_main
from server.jobs.opening import server_identity
from server.metrics import MULTIPROC_VARIABLE
from server.settings import ServeSettings

logger = logging.getLogger(__name__)

_SPAWN = multiprocessing.get_context("spawn")
# Beyond the API processes' own drain, how long they may take to exit before being killed.
EXIT_MARGIN_S = 10.0
# Least time between two starts of the engine process (a crash loop does not spin).
RESTART_BACKOFF_S = 1.0


def serve_api_servers(settings: ServeSettings) -> int:
    """Serve until SIGTERM or SIGINT (then end with its status); 1 or 2 if the model could
    not load, as `diffbatch serve`."""
    listener = _bind(settings.host, settings.port)
    with tempfile.TemporaryDirectory(prefix="diffbatch-") as private:
        metrics_dir = Path(private) / "metrics"
        metrics_dir.mkdir()
        # Read by prometheus-client as each child imports it (`server.metrics`).
        os.environ[MULTIPROC_VARIABLE] = str(metrics_dir)
        supervisor = Supervisor(settings, listener, Path(private) / "engine.sock")
        code = supervisor.run()
    listener.close()
    if supervisor.signal is not None:  # as uvicorn does: end with the signal's own status
        signal.signal(supervisor.signal, signal.SIG_DFL)
        os.kill(os.getpid(), supervisor.signal)
    return code


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, port))
    listener.listen(2048)  # uvicorn's backlog
    listener.set_inheritable(True)
    return listener


class Supervisor:
    def __init__(self, settings: ServeSettings, listener: socket.socket, engine_socket: Path) -> None:
        self._settings = settings
        self._listener = listener
        self._engine_socket = engine_socket
        self._engine: SpawnProcess | None = None
        # Each child's lifeline (`lifeline`); the engine's also says when it has started.
        self._engine_line: Connection | None = None
        self._api_lines: list[Connection | None] = [None] * settings.api_server_count
        self._engine_served = False
        self._engine_since = 0.0
        self._apis: list[SpawnProcess | None] = [None] * settings.api_server_count
        # This start of the server, named in its API processes' job owners: a job of another
        # run in the SQLite file is a dead server's, failed at once (`server.jobs.sqlite`).
        self._run = server_identity()
        self._wake_read, self._wake_write = socket.socketpair()
        self._wake_write.setblocking(False)
        self.signal: signal.Signals | None = None

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        host, port = self._listener.getsockname()[:2]
        logger.info(
            "serving on http://%s:%d: one engine process, %d API processes",
            host,
            port,
            len(self._apis),
        )
        self._start_engine()
        for index in range(len(self._apis)):
            self._start_api(index)
        code = self._watch()
        self._stop()
        return code

    def _on_signal(self, sig: int, frame: FrameType | None) -> None:
        self.signal = signal.Signals(sig)
        with contextlib.suppress(OSError):
            self._wake_write.send(b"x")

    def _start_engine(self) -> None:
        wait_s = self._engine_since + RESTART_BACKOFF_S - time.monotonic()
        if wait_s > 0:
            time.sleep(wait_s)
        if self._engine_line is not None:
            self._engine_line.close()
        mine, theirs = _SPAWN.Pipe()
        process = _SPAWN.Process(
            target=engine_main, args=(self._settings, self._engine_socket, theirs), name="diffbatch-engine"
        )
        process.start()
        theirs.close()
        self._engine, self._engine_line, self._engine_since = process, mine, time.monotonic()
        self._engine_served = False
        logger.info("engine process started (pid %d)", process.pid)

    def _start_api(self, index: int) -> None:
        old = self._api_lines[index]
        if old is not None:
            old.close()
        theirs, mine = _SPAWN.Pipe(duplex=False)
        process = _SPAWN.Process(
            target=api_main,
            args=(self._settings, [self._listener], self._engine_socket, index, theirs),
            kwargs={"run": self._run},
            name=f"diffbatch-api-{index}",
        )
        process.start()
        theirs.close()
        self._apis[index], self._api_lines[index] = process, mine
        logger.info("API server %d started (pid %d)", index, process.pid)

    def _watch(self) -> int:
        """Restart what dies until a signal; the exit status of a model that cannot load."""
        while self.signal is None:
            engine, started = self._engine, self._engine_line
            assert engine is not None and started is not None
            apis = [process for process in self._apis if process is not None]
            waitables: list[object] = [self._wake_read, engine.sentinel, *(p.sentinel for p in apis)]
            if not self._engine_served:
                waitables.append(started)
            ready = wait(waitables)  # type: ignore[arg-type]
            if started in ready and not self._engine_served:
                self._engine_served = _said_started(started)
            if not engine.is_alive() and self.signal is None:
                code = engine.exitcode
                if not self._engine_served and code in (LOAD_FAILED, SETTING_REFUSED):
                    logger.error("the engine process could not load the model; stopping the server")
                    return code or LOAD_FAILED
                logger.error("engine process %d died (exit %s); restarting it", engine.pid, code)
                self._start_engine()
            for index, process in enumerate(self._apis):
                if process is not None and not process.is_alive() and self.signal is None:
                    logger.error(
                        "API server %d (pid %d) died (exit %s); restarting it",
                        index,
                        process.pid,
                        process.exitcode,
                    )
                    self._start_api(index)
        return 0

    def _stop(self) -> None:
        """The API processes drain and end first (their requests finish), then the engine."""
        apis = [process for process in self._apis if process is not None and process.is_alive()]
        for line in self._api_lines:
            _say_stop(line)
        _join(apis, self._settings.shutdown_timeout_s + EXIT_MARGIN_S)
        engine = self._engine
        if engine is not None and engine.is_alive():
            _say_stop(self._engine_line)
            _join([engine], self._settings.shutdown_timeout_s + EXIT_MARGIN_S)
        logger.info("all processes stopped")


def _said_started(line: Connection) -> bool:
    try:
        return bool(line.recv() == "started")
    except (EOFError, OSError):  # the engine process ended before it started
        return False


def _say_stop(line: Connection | None) -> None:
    if line is not None:
        with contextlib.suppress(OSError):  # it has ended already
            line.send("stop")


def _join(processes: list[SpawnProcess], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
            logger.warning("process %d did not stop in time; killing it", process.pid)
            process.kill()
            process.join()
