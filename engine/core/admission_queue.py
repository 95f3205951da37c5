"""`AdmissionQueue`: the engine's side of a request's life from admission to its end: admit
it (or refuse it at once), queue it on the shared scheduler (request mode) or a lane's step
scheduler (step mode), abort it, send it once more after its worker died, and settle its
future exactly once. Mixed into `AsyncEngine`, which provides the attributes below."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from engine.core.admission import admitted, retry_after_s
from engine.core.config import EngineConfig
from engine.core.handle import RequestHandle, settle
from engine.core.inputs import InputLedger
from engine.core.lanes import Lane, choose_lane
from engine.core.stats import EngineObserver, EngineStats
from engine.errors import (
    DuplicateRequestError,
    EngineNotRunningError,
    QueueFullError,
    RequestAbortedError,
    WorkerCrashedError,
    WorkerMessageError,
)
from engine.request import GenerationRequest, PartialImage, RequestBatch, RequestOutput, steps_to_run
from engine.sched.deadline_admission import HeldWork, Work
from engine.sched.scheduler import Scheduler
from engine.sched.step_scheduler import StepScheduler
from engine.spec import PipelineSpec

logger = logging.getLogger("engine.core.engine")


class AdmissionQueue:
    # Set by AsyncEngine.
    config: EngineConfig
    stats: EngineStats
    observers: list[EngineObserver]
    batching: str
    _spec: PipelineSpec | None
    _lanes: list[Lane]
    _scheduler: Scheduler
    _futures: dict[str, asyncio.Future[RequestOutput]]
    _partials: dict[str, asyncio.Queue[PartialImage]]
    _held: dict[str, GenerationRequest]
    _lane_of: dict[str, Lane]
    _retried: set[str]
    _work: HeldWork
    _wakeup: asyncio.Event
    _inputs: InputLedger

    if TYPE_CHECKING:  # provided by AsyncEngine, LaneLoops and DeadlineGuard

        @property
        def is_running(self) -> bool: ...
        @property
        def num_waiting(self) -> int: ...
        @property
        def workers_up(self) -> int: ...
        def _work_of(self, request: GenerationRequest) -> Work: ...
        def _check_deadline(
            self, request: GenerationRequest, own: Work, lane: Lane | None, workers: int
        ) -> None: ...

    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Admit `request` now, raising at once if it is refused, and hand it to the caller,
        who owns it from here (see `RequestHandle`). For callers that answer before the
        result exists (streams, video jobs), so that bad input still fails the call itself."""
        request = self._admit(request)
        future: asyncio.Future[RequestOutput] = asyncio.get_running_loop().create_future()
        partials: asyncio.Queue[PartialImage] = asyncio.Queue()
        self._futures[request.request_id] = future
        self._partials[request.request_id] = partials
        return RequestHandle(request, future, partials, self.abort)

    def abort(self, request_id: str, error: Exception | None = None) -> bool:
        """Abort a waiting or running request; False if the engine does not hold it. Its
        caller gets `error` (by default `RequestAbortedError`)."""
        holder = self._holder(request_id)
        if holder is None:
            return False
        was_waiting = holder.abort(request_id)
        lane = self._lane_of.get(request_id)
        if lane is not None:
            lane.attention.set()
        self.stats.requests_aborted += 1
        for observer in self.observers:
            observer.on_abort(request_id)
        logger.info("request %s aborted while %s", request_id, "waiting" if was_waiting else "running")
        self._end(request_id, error or RequestAbortedError(f"request {request_id} was aborted"))
        for lane in self._lanes:
            batch = lane.running
            if (
                isinstance(batch, RequestBatch)
                and not lane.interrupt.is_set()
                and not any(self._scheduler.has_request(rid) for rid in batch.request_ids)
            ):
                logger.info("every request of worker %d's batch is aborted: interrupting it", lane.index)
                lane.interrupt.set()
        return True

    def abort_all(self, error: Exception) -> int:
        """End every request the engine holds with `error` (shutdown: time is up); the engine
        keeps running. Returns how many there were."""
        return sum(self.abort(request_id, error) for request_id in list(self._futures))

    def _holder(self, request_id: str) -> Scheduler | StepScheduler | None:
        """The scheduler holding `request_id` (waiting, running or decoding), if any."""
        if self.batching == "step":
            lane = self._lane_of.get(request_id)
            steps = lane.steps if lane is not None else None
            return steps if steps is not None and steps.has_request(request_id) else None
        return self._scheduler if self._scheduler.has_request(request_id) else None

    def _admit(self, request: GenerationRequest) -> GenerationRequest:
        if not self.is_running or self._spec is None:
            raise EngineNotRunningError("the engine is not running")
        if self._holder(request.request_id) is not None:
            raise DuplicateRequestError(request.request_id)
        if self.num_waiting >= self.config.max_queue_len:
            raise QueueFullError(self.config.max_queue_len, self._retry_after_s())
        request = admitted(self._spec, request)
        own = self._work_of(request)
        lane = self._route(own) if self.batching == "step" else None
        # Refused before anything is held: a refusal is never queued, so never aborted.
        # Step mode: the lane's own work, on its one worker; request mode: every worker up shares it.
        self._check_deadline(request, own, lane, 1 if lane is not None else max(1, self.workers_up))
        self._inputs.hold(request, self.config.max_queue_len, self._retry_after_s)
        self._enqueue(request)
        return request

    def _enqueue(self, request: GenerationRequest, avoid: Lane | None = None) -> None:
        """Queue an admitted request: the shared queue (request mode) or a lane's own step
        scheduler (step mode; not `avoid`, the lane whose worker just lost it, if another
        exists)."""
        spec = self._spec
        assert spec is not None
        self._held[request.request_id] = request
        work = self._work_of(request)
        self._work.hold(request.request_id, work)
        if self.batching == "step":
            lane = self._route(work, avoid)
            assert lane.steps is not None
            lane.steps.add(request, work.key, work.cost)
            self._lane_of[request.request_id] = lane
            if lane.steps.can_admit():  # else it waits for a running request to end anyway
                lane.attention.set()
        else:
            self._scheduler.add(request, work.key)
        self._wakeup.set()

    def _route(self, work: Work, avoid: Lane | None = None) -> Lane:
        """Step mode: the lane a request doing `work` joins (not `avoid` if another exists)."""
        lanes = [lane for lane in self._lanes if lane is not avoid] or self._lanes
        return lanes[choose_lane([lane.load() for lane in lanes], work.key, work.cost)]

    def _retry_after_s(self) -> float:
        """When a refused caller should come back: once the steps of every request held
        (waiting or running; a running one's steps done counted too, on the safe side; an
        image-to-image one's `steps x strength`) are done at the measured step time, with
        every worker that is up stepping (a restarting one takes no share)."""
        steps_ahead = sum(steps_to_run(r.params) for r in self._held.values())
        concurrency = self.stats.mean_step_requests * max(1, self.workers_up)
        return retry_after_s(steps_ahead=steps_ahead, step_s=self.stats.mean_step_s, concurrency=concurrency)

    def _retry(self, request_id: str, error: Exception, lane: Lane) -> bool:
        """`retry_on_worker_crash`: a request whose worker died (or answered it with a
        message the server could not read) runs once more (on another worker if there is
        one). Only once: a request that kills workers must not kill them all."""
        request = self._held.get(request_id)
        if (
            not self.config.retry_on_worker_crash
            or not isinstance(error, WorkerCrashedError | WorkerMessageError)
            or request is None
            or request_id in self._retried
        ):
            return False
        self._retried.add(request_id)
        self._lane_of.pop(request_id, None)
        logger.warning("request %s lost its worker (%s); running it once more", request_id, error)
        self._enqueue(request, avoid=lane)
        return True

    def _end(self, request_id: str, outcome: RequestOutput | Exception) -> None:
        """Resolve a request's future exactly once; a done or cancelled one is left alone."""
        self._inputs.release(request_id)
        self._held.pop(request_id, None)
        self._work.release(request_id)
        self._lane_of.pop(request_id, None)
        self._retried.discard(request_id)
        self._partials.pop(request_id, None)
        settle(self._futures.pop(request_id, None), outcome)
