"""`ProcessExecutor`: the pipeline in a worker process, restarted when it dies.

The server process keeps HTTP, JSON and media encoding; the worker (`engine.executor.worker_loop`) keeps
the model. Runs go to it as small typed messages and come back as `BatchOutput`s whose
large arrays travel through shared memory (`engine.executor.shm`). A reader thread receives
everything the worker sends and hands it to the event loop.

When the worker dies (killed, a segfault, a CUDA error that ends the process) the run in
flight fails with `WorkerCrashedError` (503) for each of its requests — in step mode for
every request the worker was holding — its leftover shared memory is swept, and a new
worker is started after a back-off (1 s, doubling to 30 s while it keeps dying at once).
Meanwhile `health()` says why (so `/health` is 503), and work that was waiting in the engine
waits for the new worker, within each request's own deadline.

A message from the worker that cannot be read (unpickled, or copied out of shared memory)
is a fault of the run it ends: that run's requests fail with `WorkerMessageError` (500),
its segments are unlinked, and the lane goes on; in step mode the worker is told to drop
their states with the next plan. `engine.executor.worker_process` holds one worker's life.
"""

from __future__ import annotations

import asyncio
import ctypes
import itertools
import logging
import multiprocessing
from collections.abc import Callable
from typing import Any

from engine.errors import ForwardError, WorkerCrashedError, WorkerMessageError
from engine.executor.abstract import Loaded
from engine.executor.held_states import HeldStates
from engine.executor.shm import sweep_orphans
from engine.executor.worker_calls import Calls
from engine.executor.worker_loop import RunBatch, RunStep, WorkerOptions
from engine.executor.worker_process import (
    InputsNotSharedError,
    SharedFlag,
    WorkerStats,
)
from engine.executor.worker_supervisor import WorkerSupervisor
from engine.logs import log_format
from engine.outputs import BatchOutput
from engine.request import RequestBatch
from engine.sched.step_plan import StepPlan, work_ids
from engine.worker.decoding import DecodeOverlap
from engine.worker.pipeline import Measure, ProgressListener
from engine.worker.stepping import Flag, PartialListener

logger = logging.getLogger(__name__)

# Loading a large model from a hub cache or a network disk can take many minutes.
DEFAULT_START_TIMEOUT_S = 3600.0
_FAILED = "the worker could not run this request (the server log says why)"

Run = RunBatch | RunStep
__all__ = ["DEFAULT_START_TIMEOUT_S", "ProcessExecutor", "SharedFlag", "WorkerStats"]
# Numbers the executors of this process, which name their input segments apart.
_executor_numbers = itertools.count(1)


class ProcessExecutor:
    """Runs go to the worker (`_call`); its spawn, death and restart are the
    `WorkerSupervisor` it holds."""

    def __init__(
        self,
        load: Callable[[], Any],
        decode_overlap: DecodeOverlap = "off",
        *,
        start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
        loading: str = "the pipeline",
        measure: Measure | None = None,
        step_once: bool = False,
    ) -> None:
        # spawn: a fresh interpreter (fork would copy the server's threads and event loop).
        self._ctx = multiprocessing.get_context("spawn")
        self._flags: list[Any] = []
        self._never = self.new_flag()  # for runs given no flag: index 0, never set
        self._loop: asyncio.AbstractEventLoop | None = None
        self._calls = Calls()
        self._held = HeldStates()  # step mode
        level = logging.getLogger().getEffectiveLevel() or logging.INFO
        options = WorkerOptions(decode_overlap, level, measure, log_format(), step_once)
        self._supervisor = WorkerSupervisor(
            self._ctx,
            load,
            options,
            self._flags,
            self._calls,
            number=next(_executor_numbers),
            start_timeout_s=start_timeout_s,
            loading=loading,
        )

    @property
    def stats(self) -> WorkerStats:
        """The worker's: alive or why not, its pid, restarts, crashes, segments received."""
        return self._supervisor.stats

    @property
    def start_timeout_s(self) -> float:
        return self._supervisor.start_timeout_s

    def new_flag(self) -> Flag:
        """A flag the worker sees too (before `start`: the worker gets them at spawn)."""
        flag = SharedFlag(self._ctx.RawValue(ctypes.c_bool, False))
        self._flags.append(flag)
        return flag

    async def start(
        self, on_progress: ProgressListener | None = None, on_partial: PartialListener | None = None
    ) -> Loaded:
        self._loop = asyncio.get_running_loop()
        orphans = await asyncio.to_thread(sweep_orphans)
        if orphans:
            logger.info("removed %d shared-memory segments of diffbatch processes that are gone", orphans)
        return await self._supervisor.start(on_progress, on_partial)

    def health(self) -> str | None:
        """None while the worker serves, else why it does not."""
        return None if self.stats.alive else self.stats.down_reason or "the worker is not running"

    async def execute_batch(self, batch: RequestBatch, interrupt: Flag | None = None) -> BatchOutput:
        flag = self._index(interrupt)
        try:
            return await self._call(lambda call_id: RunBatch(call_id, batch, flag), batch.request_ids)
        except InputsNotSharedError:
            return _not_shared(batch.request_ids)

    async def execute_step(self, plan: StepPlan, attention: Flag | None = None) -> BatchOutput:
        plan = self._held.sent(plan)
        flag = self._index(attention)
        try:
            output = await self._call(lambda call_id: RunStep(call_id, plan, flag), work_ids(plan))
        except InputsNotSharedError:
            # The plan never reached the worker: only its joiners fail (theirs are the input
            # images); the group steps next time, and the drops go with the next plan.
            self._held.unsent(plan)
            return _not_shared([r.request_id for r in plan.join])
        self._held.answered(output)
        return output

    async def shutdown(self) -> None:
        await self._supervisor.shutdown()

    # A member of a lane of several devices (`engine.executor.lane_group`) ------------------

    def watch_death(self, callback: Callable[[], None]) -> None:
        """Call `callback` on the event loop whenever the serving worker dies."""
        self._supervisor.on_death = callback

    def restart_worker(self, reason: str) -> bool:
        """Kill the serving worker (`reason`: why, for the log and `health()`); it is restarted
        after the back-off as after any death, and the runs in flight fail with 503. False
        if none was serving."""
        return self._supervisor.kill(reason)

    def forget(self, request_ids: list[str]) -> None:
        """These requests ended elsewhere: the next plan tells the worker to drop their states."""
        self._held.forget(request_ids)

    # Running --------------------------------------------------------------------------

    def _index(self, flag: Flag | None) -> int:
        if flag is None:
            return 0  # `_never`
        for index, known in enumerate(self._flags):
            if known is flag:
                return index
        raise ValueError("a flag not made by this executor's new_flag()")

    async def _call(self, message: Callable[[int], Run], request_ids: list[str]) -> BatchOutput:
        if not self.stats.alive and not self._supervisor.stopping:
            # Work that was queued when the worker died waits for the new one (each request
            # still has its own deadline); only the run in flight failed.
            await self._supervisor.serving()
        worker = self._supervisor.worker
        if worker is None or not self.stats.alive:
            return self._crashed(request_ids)
        assert self._loop is not None
        call_id, future = self._calls.open(self._loop)
        try:
            # Off the loop: packing copies input images into shared memory, sending may block.
            await asyncio.to_thread(worker.send, message(call_id))
        except InputsNotSharedError as exc:  # /dev/shm is full, say: the worker is fine
            self._calls.close(call_id)
            logger.error("could not put the input images of run %d in shared memory: %s", call_id, exc)
            raise  # the run was not sent: what fails is the caller's to say
        except (OSError, EOFError):
            self._calls.close(call_id)
            return self._crashed(request_ids)
        try:
            return await future
        except WorkerCrashedError:
            return self._crashed(request_ids)
        except WorkerMessageError as exc:
            return self._faulted(request_ids, exc)
        except Exception as exc:  # noqa: BLE001 - `Failed`: the worker's runner broke; it serves on
            logger.error("run %d failed in the worker: %s: %s", call_id, type(exc).__name__, exc)
            return self._faulted(request_ids, ForwardError(_FAILED))

    def _crashed(self, request_ids: list[str]) -> BatchOutput:
        """Every request of the run fails, and in step mode every request the dead worker
        held (their denoising state died with it)."""
        lost = {*request_ids, *self._held.died()}
        reason = self.stats.down_reason or "the worker process is not running"
        return BatchOutput(errors={rid: WorkerCrashedError(reason) for rid in lost})

    def _faulted(self, request_ids: list[str], error: Exception) -> BatchOutput:
        """A run went wrong but the worker serves on (`HeldStates.faulted`)."""
        return BatchOutput(errors={rid: error for rid in self._held.faulted(request_ids)})


def _not_shared(request_ids: list[str]) -> BatchOutput:
    error = ForwardError("the server could not pass this request's input images to its worker")
    return BatchOutput(errors=dict.fromkeys(request_ids, error))
