"""`AdmissionQueue`: a request's life in the engine from admission to its end: admit it (or
refuse it at once), queue it on the shared scheduler (request mode) or a lane's step
scheduler (step mode), abort it, send it once more after its worker died, and settle its
future exactly once. The engine holds one; its lane loops take work from the schedulers it
fills and hand each outcome back to it (`end`, `retry`)."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Mapping

from engine.core.admission import admitted, retry_after_s
from engine.core.deadline_guard import DeadlineGuard
from engine.core.handle import RequestHandle, settle
from engine.core.inputs import InputLedger
from engine.core.lanes import Lane, choose_lane, workers_up
from engine.core.stats import EngineObserver, EngineStats
from engine.core.timelines import Timelines
from engine.errors import (
    DuplicateRequestError,
    EngineNotRunningError,
    QueueFullError,
    RequestAbortedError,
    WorkerCrashedError,
    WorkerMessageError,
)
from engine.logs import log_event
from engine.request import GenerationRequest, PartialImage, RequestBatch, RequestOutput, steps_to_run
from engine.sched.deadline_admission import HeldWork, Work
from engine.sched.scheduler import Scheduler
from engine.sched.step_scheduler import StepScheduler
from engine.spec import PipelineSpec

logger = logging.getLogger("engine.core.engine")


def _log_finished(request: GenerationRequest, future: asyncio.Future[RequestOutput]) -> None:
    """The `finished` event of a request's life: its outcome (ok, error, aborted) and its
    seconds since arrival."""
    seconds = round(time.monotonic() - request.arrival_time, 3)
    error = None if future.cancelled() else future.exception()
    if future.cancelled() or isinstance(error, RequestAbortedError):
        outcome = "aborted"
    else:
        outcome = "ok" if error is None else "error"
    log_event(
        "finished",
        "request %s finished: %s",
        request.request_id,
        outcome,
        request_id=request.request_id,
        outcome=outcome,
        error=None if error is None else type(error).__name__,
        seconds=seconds,
    )


class AdmissionQueue:
    """Admits into `lanes`' work; `work` is what each held request still has to run (shared
    with the lane loops, which learn it, and the deadline guard, which reads it). Refuses
    everything until `open` (the engine's start) and after `close` (its stop, or a loop
    that died)."""

    def __init__(
        self,
        lanes: list[Lane],
        work: HeldWork,
        stats: EngineStats,
        observer: EngineObserver,
        *,
        max_queue_len: int,
        max_input_bytes: int | None,
        retry_on_worker_crash: bool,
        scheduler: Scheduler,
        batching: str,
    ) -> None:
        self._lanes = lanes
        self._work = work
        self._stats = stats
        self._observer = observer
        self._max_queue_len = max_queue_len
        self._retry_on_worker_crash = retry_on_worker_crash
        # Request mode: the one queue every lane pulls batches from.
        self.scheduler = scheduler
        self.batching = batching
        self._spec: PipelineSpec | None = None
        self._guard: DeadlineGuard | None = None
        self._open = False
        # Set when there is news for the lane loops: a request queued, a unit of work done.
        self.wakeup = asyncio.Event()
        self._futures: dict[str, asyncio.Future[RequestOutput]] = {}
        self._partials: dict[str, asyncio.Queue[PartialImage]] = {}
        # Every request held, as admitted (a worker crash may send it again), and in step
        # mode the lane it was routed to.
        self._held: dict[str, GenerationRequest] = {}
        self._lane_of: dict[str, Lane] = {}
        self._retried: set[str] = set()
        self._inputs = InputLedger(max_input_bytes)
        # What each held request's time goes to; the lane loops fill them in.
        self.timelines = Timelines()

    def open(self, spec: PipelineSpec, guard: DeadlineGuard, batching: str, scheduler: Scheduler) -> None:
        """Start admitting, for the pipeline `spec` describes, in the batching mode the engine
        resolved (`scheduler`: request mode's shared queue)."""
        self._spec, self._guard = spec, guard
        self.batching, self.scheduler = batching, scheduler
        self._open = True

    def close(self) -> None:
        """Admit nothing more (what is held stays, to be ended or aborted)."""
        self._open = False

    @property
    def held(self) -> Mapping[str, GenerationRequest]:
        """Every request held, by id, as admitted."""
        return self._held

    def lane_of(self, request_id: str) -> Lane | None:
        """Step mode: the lane `request_id` was routed to."""
        return self._lane_of.get(request_id)

    @property
    def num_waiting(self) -> int:
        if self.batching == "step":
            return sum(lane.steps.num_waiting for lane in self._lanes if lane.steps is not None)
        return self.scheduler.num_waiting

    @property
    def num_running(self) -> int:
        if self.batching == "step":
            return sum(lane.steps.num_running for lane in self._lanes if lane.steps is not None)
        return self.scheduler.num_running

    @property
    def num_unfinished(self) -> int:
        return len(self._futures)  # each request's future, until it ends

    @property
    def input_bytes(self) -> int:
        """Bytes of input images held by requests in progress."""
        return self._inputs.total

    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Admit `request` now, raising at once if it is refused, and hand it to the caller,
        who owns it from here (see `RequestHandle`). For callers that answer before the
        result exists (streams, video jobs), so that bad input still fails the call itself."""
        request = self._admit(request)
        self.timelines.open(request.request_id, time.monotonic())
        future: asyncio.Future[RequestOutput] = asyncio.get_running_loop().create_future()
        partials: asyncio.Queue[PartialImage] = asyncio.Queue()
        self._futures[request.request_id] = future
        self._partials[request.request_id] = partials
        log_event("queued", "request %s queued", request.request_id, request_id=request.request_id)
        # Added here, so the callback runs in the caller's context (the request's log fields).
        future.add_done_callback(functools.partial(_log_finished, request))
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
        self._stats.requests_aborted += 1
        self._observer.on_abort(request_id)
        logger.info("request %s aborted while %s", request_id, "waiting" if was_waiting else "running")
        self.end(request_id, error or RequestAbortedError(f"request {request_id} was aborted"))
        for lane in self._lanes:
            batch = lane.running
            if (
                isinstance(batch, RequestBatch)
                and not lane.interrupt.is_set()
                and not any(self.scheduler.has_request(rid) for rid in batch.request_ids)
            ):
                logger.info("every request of worker %d's batch is aborted: interrupting it", lane.index)
                lane.interrupt.set()
        return True

    def abort_all(self, error: Exception) -> int:
        """End every request the engine holds with `error` (shutdown: time is up); the engine
        keeps running. Returns how many there were."""
        return sum(self.abort(request_id, error) for request_id in list(self._futures))

    def end_all(self, error: Exception) -> None:
        """Settle every request's future with `error` (the engine stops)."""
        for request_id in list(self._futures):
            self.end(request_id, error)

    def route_partial(self, partial: PartialImage) -> None:
        """A preview to its request's caller (dropped if the request has ended meanwhile)."""
        queue = self._partials.get(partial.request_id)
        if queue is not None:
            queue.put_nowait(partial)

    def _holder(self, request_id: str) -> Scheduler | StepScheduler | None:
        """The scheduler holding `request_id` (waiting, running or decoding), if any."""
        if self.batching == "step":
            lane = self._lane_of.get(request_id)
            steps = lane.steps if lane is not None else None
            return steps if steps is not None and steps.has_request(request_id) else None
        return self.scheduler if self.scheduler.has_request(request_id) else None

    def _admit(self, request: GenerationRequest) -> GenerationRequest:
        if not self._open or self._spec is None or self._guard is None:
            raise EngineNotRunningError("the engine is not running")
        if self._holder(request.request_id) is not None:
            raise DuplicateRequestError(request.request_id)
        if self.num_waiting >= self._max_queue_len:
            raise QueueFullError(self._max_queue_len, self._retry_after_s())
        request = admitted(self._spec, request)
        own = self._work_of(request)
        lane = self._route(own) if self.batching == "step" else None
        # Refused before anything is held: a refusal is never queued, so never aborted.
        # Step mode: the lane's own work, on its one worker; request mode: every worker up shares it.
        steps = lane.steps if lane is not None else None
        where = steps if steps is not None else self.scheduler
        workers = 1 if lane is not None else max(1, workers_up(self._lanes))
        self._guard.check(request, own, self._held.values(), where, workers)
        self._inputs.hold(request, self._max_queue_len, self._retry_after_s)
        self.enqueue(request)
        return request

    def _work_of(self, request: GenerationRequest) -> Work:
        """What an admitted request runs: its steps, each of its step cost, with the key it is
        batched by in this batching mode."""
        spec = self._spec
        assert spec is not None
        key = spec.step_key(request) if self.batching == "step" else spec.batch_key(request)
        grid = spec.step_grid(request) if self.batching == "step" else ()
        packs = self.batching == "step" and spec.step_packs(request)
        return Work(key, spec.step_cost(request), steps_to_run(request.params), grid, packs)

    def enqueue(self, request: GenerationRequest, avoid: Lane | None = None) -> None:
        """Queue an admitted request: the shared queue (request mode) or a lane's own step
        scheduler (step mode; not `avoid`, the lane whose worker just lost it, if another
        exists)."""
        self._held[request.request_id] = request
        work = self._work_of(request)
        self._work.hold(request.request_id, work)
        if self.batching == "step":
            lane = self._route(work, avoid)
            assert lane.steps is not None
            lane.steps.add(request, work.key, work.cost, work.grid, work.packs)
            self._lane_of[request.request_id] = lane
            if lane.steps.can_admit():  # else it waits for a running request to end anyway
                lane.attention.set()
        else:
            self.scheduler.add(request, work.key)
        self.wakeup.set()

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
        concurrency = self._stats.mean_step_requests * max(1, workers_up(self._lanes))
        return retry_after_s(steps_ahead=steps_ahead, step_s=self._stats.mean_step_s, concurrency=concurrency)

    def retry(self, request_id: str, error: Exception, lane: Lane) -> bool:
        """`retry_on_worker_crash`: a request whose worker died (or answered it with a
        message the server could not read) runs once more (on another worker if there is
        one). Only once: a request that kills workers must not kill them all."""
        request = self._held.get(request_id)
        if (
            not self._retry_on_worker_crash
            or not isinstance(error, WorkerCrashedError | WorkerMessageError)
            or request is None
            or request_id in self._retried
        ):
            return False
        self._retried.add(request_id)
        self._lane_of.pop(request_id, None)
        self.timelines.retried(request_id)
        logger.warning("request %s lost its worker (%s); running it once more", request_id, error)
        self.enqueue(request, avoid=lane)
        return True

    def end(self, request_id: str, outcome: RequestOutput | Exception) -> None:
        """Resolve a request's future exactly once; a done or cancelled one is left alone."""
        self._inputs.release(request_id)
        request = self._held.pop(request_id, None)
        self._work.release(request_id)
        self._lane_of.pop(request_id, None)
        self._retried.discard(request_id)
        self._partials.pop(request_id, None)
        settle(self._futures.pop(request_id, None), outcome)
        timeline = self.timelines.close(request_id, time.monotonic())
        if request is not None and timeline is not None:
            error = outcome if isinstance(outcome, Exception) else None
            self._observer.on_request_end(request, timeline, error)
