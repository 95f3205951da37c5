"""`ProcessExecutor`: the pipeline in a worker process, restarted when it dies.

The server process keeps HTTP, JSON and media encoding; the worker (`engine.worker`) keeps
the model. Runs go to it as small typed messages and come back as `BatchOutput`s whose
large arrays travel through shared memory (`engine.shm`). A reader thread receives
everything the worker sends and hands it to the event loop.

When the worker dies (killed, a segfault, a CUDA error that ends the process) the run in
flight fails with `WorkerCrashedError` (503) for each of its requests — in step mode for
every request the worker was holding — its leftover shared memory is swept, and a new
worker is started after a back-off (1 s, doubling to 30 s while it keeps dying at once).
Meanwhile `health()` says why (so `/health` is 503), and work that was waiting in the engine
waits for the new worker, within each request's own deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import logging
import multiprocessing
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from engine.decoding import DecodeOverlap
from engine.errors import WorkerCrashedError
from engine.executor import PipelineSpec, ProgressListener, load_configured
from engine.forward import BatchOutput
from engine.request import RequestBatch
from engine.shm import Packer, count_shared, sweep, sweep_orphans, unpack, worker_prefix
from engine.step_scheduler import StepPlan, work_ids
from engine.stepping import Flag, PartialListener
from engine.worker import (
    Done,
    Failed,
    LoadFailed,
    Partial,
    Progress,
    Ready,
    RunBatch,
    RunStep,
    Stop,
    WorkerOptions,
    serve,
)

if TYPE_CHECKING:
    from pipelines.base import PipelineConfig

logger = logging.getLogger(__name__)

_FIRST_BACKOFF_S = 1.0
_MAX_BACKOFF_S = 30.0
# A worker that lived this long before dying is not crash-looping: back-off starts over.
_HEALTHY_AFTER_S = 60.0
_STOP_GRACE_S = 10.0

Run = RunBatch | RunStep


@dataclass(slots=True)
class WorkerStats:
    restarts: int = 0
    crashes: int = 0
    alive: bool = False
    # Why the worker is not serving, while it is not.
    down_reason: str | None = None
    segments_received: int = 0
    pid: int | None = None
    started_at: float = 0.0


class ProcessExecutor:
    def __init__(
        self,
        load: Callable[[], Any],
        decode_overlap: DecodeOverlap = "off",
        *,
        start_timeout_s: float = 600.0,
    ) -> None:
        self._load = load
        self._options = WorkerOptions(decode_overlap, logging.getLogger().getEffectiveLevel() or logging.INFO)
        self._start_timeout_s = start_timeout_s
        # spawn: a fresh interpreter (fork would copy the server's threads and event loop).
        self._ctx = multiprocessing.get_context("spawn")
        self._flags: list[Any] = []
        self._never = self.new_flag()  # for runs given no flag: index 0, never set
        self._process: Any = None
        self._conn: Connection | None = None
        self._reader: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._calls: dict[int, asyncio.Future[BatchOutput]] = {}
        self._call_ids = 0
        # Step mode: requests whose state the worker holds (joined, not yet ended).
        self._holding: set[str] = set()
        self._on_progress: ProgressListener | None = None
        self._on_partial: PartialListener | None = None
        # Input images to the worker go through shared memory too, under a prefix of ours.
        self._to_worker = f"{worker_prefix()}in-"
        self._packer = Packer(self._to_worker)
        self._stopping = False
        self._restart: asyncio.Task[None] | None = None
        self._serving = asyncio.Event()  # set while a worker serves
        self._backoff_s = _FIRST_BACKOFF_S
        self.stats = WorkerStats()

    @classmethod
    def for_config(cls, config: PipelineConfig, decode_overlap: DecodeOverlap = "off") -> ProcessExecutor:
        return cls(functools.partial(load_configured, config), decode_overlap)

    def new_flag(self) -> Flag:
        """A flag the worker sees too (before `start`: the worker gets them at spawn)."""
        flag = SharedFlag(self._ctx.RawValue(ctypes.c_bool, False))
        self._flags.append(flag)
        return flag

    async def start(
        self, on_progress: ProgressListener | None = None, on_partial: PartialListener | None = None
    ) -> PipelineSpec:
        self._loop = asyncio.get_running_loop()
        self._on_progress, self._on_partial = on_progress, on_partial
        orphans = await asyncio.to_thread(sweep_orphans)
        if orphans:
            logger.info("removed %d shared-memory segments of diffbatch processes that are gone", orphans)
        return await self._spawn()

    def health(self) -> str | None:
        """None while the worker serves, else why it does not."""
        return None if self.stats.alive else self.stats.down_reason or "the worker is not running"

    async def execute_batch(self, batch: RequestBatch, interrupt: Flag | None = None) -> BatchOutput:
        flag = self._index(interrupt)
        return await self._call(lambda call_id: RunBatch(call_id, batch, flag), batch.request_ids)

    async def execute_step(self, plan: StepPlan, attention: Flag | None = None) -> BatchOutput:
        self._holding.update(r.request_id for r in plan.join)
        self._holding.difference_update(plan.drop)
        flag = self._index(attention)
        output = await self._call(lambda call_id: RunStep(call_id, plan, flag), work_ids(plan))
        self._holding.difference_update([*output.outputs, *output.errors])
        return output

    async def shutdown(self) -> None:
        self._stopping = True
        self._serving.set()  # runs waiting for a restart give up now
        if self._restart is not None:
            self._restart.cancel()
        await asyncio.to_thread(self._stop_worker)

    # Running --------------------------------------------------------------------------

    def _index(self, flag: Flag | None) -> int:
        if flag is None:
            return 0  # `_never`
        for index, known in enumerate(self._flags):
            if known is flag:
                return index
        raise ValueError("a flag not made by this executor's new_flag()")

    async def _call(self, message: Callable[[int], Run], request_ids: list[str]) -> BatchOutput:
        if not self.stats.alive and not self._stopping:
            # Work that was queued when the worker died waits for the new one (each request
            # still has its own deadline); only the run in flight failed.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._serving.wait(), self._start_timeout_s)
        conn = self._conn
        if conn is None or not self.stats.alive:
            return self._crashed(request_ids)
        assert self._loop is not None
        self._call_ids += 1
        call_id = self._call_ids
        future: asyncio.Future[BatchOutput] = self._loop.create_future()
        self._calls[call_id] = future
        try:
            # Off the loop: packing copies input images into shared memory, sending may block.
            await asyncio.to_thread(lambda: conn.send(self._packer.pack(message(call_id))))
        except (OSError, EOFError):
            self._calls.pop(call_id, None)
            return self._crashed(request_ids)
        try:
            return await future
        except WorkerCrashedError:
            return self._crashed(request_ids)

    def _crashed(self, request_ids: list[str]) -> BatchOutput:
        """Every request of the run fails, and in step mode every request the dead worker
        held (their denoising state died with it)."""
        lost = {*request_ids, *self._holding}
        self._holding.clear()
        reason = self.stats.down_reason or "the worker process is not running"
        return BatchOutput(errors={rid: WorkerCrashedError(reason) for rid in lost})

    # The worker's life ----------------------------------------------------------------

    async def _spawn(self) -> PipelineSpec:
        parent, child = self._ctx.Pipe()
        process = self._ctx.Process(
            target=serve,
            args=(self._load, self._options, child, self._flags),
            name="diffbatch-worker",
            daemon=True,
        )
        process.start()
        child.close()
        ready = await asyncio.to_thread(_wait_ready, parent, process, self._start_timeout_s)
        self._process, self._conn = process, parent
        self.stats.alive, self.stats.down_reason = True, None
        self._serving.set()
        self.stats.pid, self.stats.started_at = ready.pid, time.monotonic()
        logger.info("worker process %d serving", ready.pid)
        self._reader = threading.Thread(
            target=self._read, args=(parent, process), name="diffbatch-worker-reader"
        )
        self._reader.daemon = True
        self._reader.start()
        spec: PipelineSpec = ready.spec
        return spec

    def _read(self, conn: Connection, process: Any) -> None:
        """The reader thread: everything the worker sends, until its end of the pipe closes."""
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                break
            try:
                self.stats.segments_received += count_shared(message)
                message = unpack(message)
            except Exception:
                logger.exception("could not read a message from the worker")
                continue
            self._deliver(message)
        process.join(timeout=5)
        code = process.exitcode
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # the loop is closed: the server is gone
            self._loop.call_soon_threadsafe(self._worker_died, process.pid, code)

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
            loop.call_soon_threadsafe(self._settle, message)

    def _settle(self, message: Done | Failed) -> None:
        future = self._calls.pop(message.call_id, None)
        if future is None or future.done():
            return
        if isinstance(message, Done):
            future.set_result(message.output)
        else:
            future.set_exception(message.error)

    def _worker_died(self, pid: int, code: int | None) -> None:
        if self._stopping:
            return
        self.stats.alive = False
        self._serving.clear()
        self.stats.crashes += 1
        self.stats.down_reason = f"the worker process {pid} died (exit code {code}); restarting it"
        logger.error("worker process %d died (exit code %s); its requests fail with 503", pid, code)
        # What the dead worker shared and nobody read, and inputs it never read.
        swept = sweep(worker_prefix(pid)) + sweep(self._to_worker)
        if swept:
            logger.info("removed %d shared-memory segments the dead worker left", swept)
        for future in self._calls.values():
            if not future.done():
                future.set_exception(WorkerCrashedError(self.stats.down_reason))
        self._calls.clear()
        self._conn = None
        if time.monotonic() - self.stats.started_at > _HEALTHY_AFTER_S:
            self._backoff_s = _FIRST_BACKOFF_S
        self._restart = asyncio.get_running_loop().create_task(self._restart_after(self._backoff_s))
        self._backoff_s = min(_MAX_BACKOFF_S, self._backoff_s * 2)

    async def _restart_after(self, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        while not self._stopping:
            try:
                await self._spawn()
            except Exception as exc:
                self.stats.down_reason = f"restarting the worker failed: {exc}"
                logger.exception("restarting the worker failed")
                await asyncio.sleep(self._backoff_s)
                self._backoff_s = min(_MAX_BACKOFF_S, self._backoff_s * 2)
                continue
            self.stats.restarts += 1
            return

    def _stop_worker(self) -> None:
        process, conn = self._process, self._conn
        if conn is not None:
            with contextlib.suppress(OSError, EOFError):
                conn.send(Stop())
        if process is not None:
            process.join(timeout=_STOP_GRACE_S)
            if process.is_alive():
                process.kill()
                process.join(timeout=5)
            sweep(worker_prefix(process.pid))
        if conn is not None:
            conn.close()
        if self._reader is not None:
            self._reader.join(timeout=5)
        self.stats.alive = False
        self.stats.down_reason = "stopped"


class SharedFlag:
    """A `Flag` both processes see: one byte of shared memory. No lock and no semaphore
    (so nothing for the resource tracker to report at exit): the engine only sets and
    clears it, the worker only reads it between steps, and a read that misses a set by
    a moment costs one more step at most."""

    def __init__(self, value: Any) -> None:
        self._value = value

    def set(self) -> None:
        self._value.value = True

    def clear(self) -> None:
        self._value.value = False

    def is_set(self) -> bool:
        return bool(self._value.value)

    def wait(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.is_set():
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(0.005)
        return True


def _wait_ready(conn: Connection, process: Any, timeout_s: float) -> Ready:
    """The worker's first message: Ready, or why it could not load."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if conn.poll(0.5):
            try:
                message = conn.recv()
            except EOFError:
                break
            if isinstance(message, Ready):
                return message
            if isinstance(message, LoadFailed):
                process.join(timeout=5)
                raise RuntimeError(f"the worker could not load the pipeline: {message.message}")
        if not process.is_alive():
            break
    process.kill()
    process.join(timeout=5)
    raise RuntimeError(f"the worker process did not start (exit code {process.exitcode})")
