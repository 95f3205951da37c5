"""`WorkerSupervisor`: the life of `ProcessExecutor`'s worker: spawn it, read what it sends
(a reader thread hands everything to the event loop), and when it dies fail the runs in
flight, sweep its shared memory and start a new one after a back-off (1 s, doubling to 30 s
while it keeps dying at once). `ProcessExecutor` holds one and sends its runs to the
worker it keeps (`worker`, once `serving`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from engine.errors import WorkerCrashedError, WorkerMessageError
from engine.executor.abstract import Loaded
from engine.executor.shm import inputs_prefix
from engine.executor.worker_calls import Calls
from engine.executor.worker_loop import Done, Failed, Partial, Progress, WorkerOptions
from engine.executor.worker_process import Unreadable, WorkerProcess, WorkerStats, release_resource_tracker
from engine.worker.pipeline import ProgressListener
from engine.worker.stepping import PartialListener

logger = logging.getLogger("engine.executor.process_executor")

FIRST_BACKOFF_S = 1.0
_MAX_BACKOFF_S = 30.0
# A worker that lived this long before dying is not crash-looping: back-off starts over.
_HEALTHY_AFTER_S = 60.0
_UNREADABLE = "the worker's result for this request could not be read (the server log says why)"


class WorkerSupervisor:
    """Keeps one worker process serving: spawned in `ctx` to call `load`, given `flags`
    (the executor's, made before `start`), settling `calls` with what it answers."""

    def __init__(
        self,
        ctx: Any,
        load: Callable[[], Any],
        options: WorkerOptions,
        flags: list[Any],
        calls: Calls,
        *,
        number: int,
        start_timeout_s: float,
        loading: str,
    ) -> None:
        self._ctx = ctx
        self._load = load
        self._options = options
        self._flags = flags
        self._calls = calls
        # Numbers the executors of this process, which name their input segments apart.
        self._number = number
        # How long a worker may take to load (`loading`: what, for the log).
        self.start_timeout_s = start_timeout_s
        self._loading = loading
        self._workers_started = 0
        self._worker: WorkerProcess | None = None  # starting or serving
        self._reader: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_progress: ProgressListener | None = None
        self._on_partial: PartialListener | None = None
        self._stopping = False
        self._restart: asyncio.Task[None] | None = None
        self._serving = asyncio.Event()  # set while a worker serves
        self._backoff_s = FIRST_BACKOFF_S
        self.stats = WorkerStats()
        # Told when a serving worker dies, on the event loop (a lane of several devices
        # restarts its other members: `engine.executor.lane_group`).
        self.on_death: Callable[[], None] | None = None
        # Why the worker was killed on purpose (`kill`), for the log and `health()`.
        self._killed_because: str | None = None

    @property
    def worker(self) -> WorkerProcess | None:
        """The worker, starting or serving (None before the first spawn)."""
        return self._worker

    @property
    def stopping(self) -> bool:
        return self._stopping

    async def start(self, on_progress: ProgressListener | None, on_partial: PartialListener | None) -> Loaded:
        """Spawn the first worker; what it answers the listeners hear on this event loop."""
        self._loop = asyncio.get_running_loop()
        self._on_progress, self._on_partial = on_progress, on_partial
        return await self._spawn()

    async def serving(self) -> None:
        """Until a worker serves (one restarting after a crash), at most `start_timeout_s`,
        or the executor shuts down."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._serving.wait(), self.start_timeout_s)

    async def shutdown(self) -> None:
        self._stopping = True
        self._serving.set()  # runs waiting for a restart give up now
        if self._restart is not None:
            self._restart.cancel()
        await asyncio.to_thread(self._stop_worker)

    def kill(self, reason: str) -> bool:
        """Kill the serving worker (its death is handled as any other: runs in flight fail,
        it is restarted after the back-off); `reason` says why in the log and `health()`.
        False if none was serving."""
        worker = self._worker
        if worker is None or not self.stats.alive or self._stopping:
            return False
        self._killed_because = reason
        logger.warning("killing worker process %d: %s", worker.pid, reason)
        worker.process.kill()
        return True

    async def _spawn(self) -> Loaded:
        self._workers_started += 1
        worker = WorkerProcess(
            self._ctx,
            self._load,
            self._options,
            self._flags,
            inputs=inputs_prefix(self._number, self._workers_started),
            loading=self._loading,
        )
        self._worker = worker  # from now on, shutdown stops it, loaded or not
        ready = await asyncio.to_thread(worker.wait_ready, self.start_timeout_s)
        self.stats.alive, self.stats.down_reason = True, None
        self._serving.set()
        self.stats.pid, self.stats.started_at = ready.pid, time.monotonic()
        logger.info("worker process %d serving", ready.pid)
        self._reader = threading.Thread(target=self._read, args=(worker,), name="diffbatch-worker-reader")
        self._reader.daemon = True
        self._reader.start()
        return Loaded(ready.spec, ready.report)

    def _read(self, worker: WorkerProcess) -> None:
        """The reader thread: everything the worker sends, until its end of the pipe closes."""
        loop = self._loop
        assert loop is not None
        for message in worker.receive(self.stats):
            if isinstance(message, Unreadable):
                error = WorkerMessageError(_UNREADABLE)  # None: every run in flight (at most one)
                loop.call_soon_threadsafe(self._calls.fail, message.call_id, error)
            else:
                self._deliver(message)
        worker.process.join(timeout=5)
        with contextlib.suppress(RuntimeError):  # the loop is closed: the server is gone
            loop.call_soon_threadsafe(self._worker_died, worker, worker.process.exitcode)

    def _deliver(self, message: Any) -> None:
        loop = self._loop
        assert loop is not None
        if isinstance(message, Progress):
            if self._on_progress is not None:
                loop.call_soon_threadsafe(self._on_progress, message.request_ids, message.done, message.total)
        elif isinstance(message, Partial):
            if self._on_partial is not None:
                loop.call_soon_threadsafe(self._on_partial, message.partial)
        elif isinstance(message, Done | Failed):
            loop.call_soon_threadsafe(self._calls.settle, message)

    def _worker_died(self, worker: WorkerProcess, code: int | None) -> None:
        if self._stopping:
            return
        self.stats.alive = False
        self._serving.clear()
        self.stats.crashes += 1
        why, self._killed_because = self._killed_because, None
        if why is None:
            self.stats.down_reason = f"the worker process {worker.pid} died (exit code {code}); restarting it"
            logger.error(
                "worker process %d died (exit code %s); its requests fail with 503", worker.pid, code
            )
        else:
            self.stats.down_reason = f"the worker process {worker.pid} was restarted: {why}"
        # What the dead worker shared and nobody read, and inputs it never read: its own only.
        swept = worker.sweep()
        if swept:
            logger.info("removed %d shared-memory segments the dead worker left", swept)
        self._calls.fail(None, WorkerCrashedError(self.stats.down_reason))
        if time.monotonic() - self.stats.started_at > _HEALTHY_AFTER_S:
            self._backoff_s = FIRST_BACKOFF_S
        self._restart = asyncio.get_running_loop().create_task(self._restart_after(self._backoff_s))
        self._backoff_s = min(_MAX_BACKOFF_S, self._backoff_s * 2)
        if self.on_death is not None:
            self.on_death()

    async def _restart_after(self, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        while not self._stopping:
            try:
                await self._spawn()
            except Exception as exc:
                if self._stopping:  # shutdown stopped the worker while it loaded
                    return
                self.stats.down_reason = f"restarting the worker failed: {exc}"
                logger.exception("restarting the worker failed")
                await asyncio.sleep(self._backoff_s)
                self._backoff_s = min(_MAX_BACKOFF_S, self._backoff_s * 2)
                continue
            self.stats.restarts += 1
            return

    def _stop_worker(self) -> None:
        if self._worker is not None:
            self._worker.stop()
        if self._reader is not None:
            self._reader.join(timeout=5)
        self.stats.alive = False
        self.stats.down_reason = "stopped"
        release_resource_tracker()
