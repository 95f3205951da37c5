"""`AsyncEngine`: admits requests, runs the engine loop, and resolves each request's future.

The loop is one asyncio task per lane (a worker: one executor, `engine.lanes`): wait for
work → schedule (a `RequestBatch` in request-level batching, a `StepPlan` in step-level) →
execute it off the event loop → route each outcome by `request_id`. Only what one unit of
work is changes between the two modes; with `--data-parallel-size N` there are N lanes
whose work runs in parallel (how requests reach them: `engine.lanes`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from dataclasses import replace

from engine.admission import AdmissionWait, admitted, retry_after_s, steps_to_run
from engine.config import EngineConfig
from engine.deadline_admission import HeldWork, Work
from engine.deadline_guard import DeadlineGuard
from engine.errors import (
    DuplicateRequestError,
    EngineNotRunningError,
    QueueFullError,
    RequestAbortedError,
    WorkerCrashedError,
    WorkerMessageError,
)
from engine.executor import Executor, PipelineSpec
from engine.handle import RequestHandle, settle
from engine.inputs import InputLedger, prepared_inputs
from engine.lane_loop import LaneLoops
from engine.lanes import Lane, choose_lane
from engine.profile_run import ProfileResult
from engine.request import (
    BatchKey,
    GenerationRequest,
    PartialImage,
    RequestBatch,
    RequestOutput,
    SamplingParams,
)
from engine.scheduler import Scheduler
from engine.stats import EngineObserver, EngineStats
from engine.step_groups import WorkPace
from engine.step_scheduler import StepScheduler

logger = logging.getLogger(__name__)


class AsyncEngine(LaneLoops, DeadlineGuard):
    """`executor` is one executor, or one per data-parallel worker (all serving the same
    model, each on its own device). The loops that run the work are `LaneLoops`;
    admission by deadline is `DeadlineGuard`."""

    def __init__(self, executor: Executor | Sequence[Executor], config: EngineConfig | None = None) -> None:
        self.config = config or EngineConfig()
        self.stats = EngineStats()
        self.observers: list[EngineObserver] = []
        executors = list(executor) if isinstance(executor, Sequence) else [executor]
        if not executors:
            raise ValueError("an engine needs at least one executor")
        # Flags are made before the executors start (a worker process gets them at spawn).
        self._lanes = [Lane(i, ex, ex.new_flag(), ex.new_flag()) for i, ex in enumerate(executors)]
        self._spec: PipelineSpec | None = None
        # Request mode: the one queue every lane pulls batches from.
        self._scheduler = Scheduler(self.config.max_num_seqs, aging_s=self.config.priority_aging_s)
        self.batching = self.config.batching
        self._admission = AdmissionWait.from_ms(self.config.request_batch_max_wait_ms)
        self._futures: dict[str, asyncio.Future[RequestOutput]] = {}
        self._partials: dict[str, asyncio.Queue[PartialImage]] = {}
        # Every request held, as admitted (a worker crash may send it again), and in step
        # mode the lane it was routed to.
        self._held: dict[str, GenerationRequest] = {}
        self._lane_of: dict[str, Lane] = {}
        self._retried: set[str] = set()
        # What each held request still has to run, and the step rates learnt (admission by deadline).
        self._work = HeldWork()
        self._wakeup = asyncio.Event()
        self._inputs = InputLedger(self.config.max_input_bytes)
        self._tasks: list[asyncio.Task[None]] = []
        # Why the engine stopped serving on its own (its loop died), for /health.
        self.failure: str | None = None
        # What the profile run at start found (`engine.profile_run`), for /health and /metrics;
        # None when no executor was asked to profile.
        self.profile: ProfileResult | None = None
        self._profiles: list[ProfileResult] = []

    @property
    def executor(self) -> Executor:
        """The first lane's executor (the only one without data parallelism)."""
        return self._lanes[0].executor

    @property
    def lanes(self) -> list[Lane]:
        return list(self._lanes)

    @property
    def unavailable(self) -> str | None:
        """Why no worker can run work just now (their processes are restarting); None while
        at least one can."""
        if self.workers_up:
            return None
        return self._lanes[0].executor.health()

    @property
    def is_running(self) -> bool:
        return bool(self._tasks) and all(not task.done() for task in self._tasks)

    @property
    def modality(self) -> str:
        """What the served pipeline makes: image, video or edit (known once started)."""
        return self._spec.modality if self._spec is not None else "unknown"

    @property
    def input_bytes(self) -> int:
        """Bytes of input images held by requests in progress."""
        return self._inputs.total

    @property
    def scheduler(self) -> Scheduler | StepScheduler:
        """Request mode: the shared queue; step mode: the first lane's step scheduler (the
        engine's `num_waiting` and `num_running` count every lane)."""
        steps = self._lanes[0].steps
        return steps if self.batching == "step" and steps is not None else self._scheduler

    @property
    def spec(self) -> PipelineSpec | None:
        """What the served pipeline answers on the event loop (once started)."""
        return self._spec

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights the served pipeline holds (0 until started, or when unknown)."""
        return int(getattr(self._spec, "weight_bytes", 0))

    @property
    def image_caps(self) -> dict[BatchKey, int]:
        return self._scheduler.image_caps

    @property
    def out_of_memory_in_halves(self) -> dict[str, int]:
        return dict(self.stats.out_of_memory)

    @property
    def prompt_cache(self) -> dict[str, float]:
        return self.stats.prompt_cache_totals()

    @property
    def answers_by_replica(self) -> dict[str, int]:
        return {}  # the engine is here, not behind Ray Serve replicas

    @property
    def num_waiting(self) -> int:
        if self.batching == "step":
            return sum(lane.steps.num_waiting for lane in self._lanes if lane.steps is not None)
        return self._scheduler.num_waiting

    @property
    def num_running(self) -> int:
        if self.batching == "step":
            return sum(lane.steps.num_running for lane in self._lanes if lane.steps is not None)
        return self._scheduler.num_running

    @property
    def num_unfinished(self) -> int:
        return len(self._futures)  # each request's future, until it ends

    async def start(self) -> None:
        spec = await self._start_executors()
        self._spec = spec
        self._fit_to_profile()
        batching = bool(spec.supports_request_batch)
        self.batching = self.config.batching
        if self.batching == "step" and not spec.supports_step_batch:
            logger.warning("this pipeline cannot step requests together; using request-level batching")
            self.batching = "request"
        if self.batching == "step":
            # Requests join between steps, so holding them at admission never pays.
            budget = self._step_budget(spec)
            for lane in self._lanes:
                lane.steps = StepScheduler(
                    self.config.max_num_seqs,
                    budget,
                    self.config.max_loras,
                    self.config.priority_aging_s,
                    preemption=self.config.preemption,
                    pace=WorkPace(self._work) if self.config.deadline_groups else None,
                )
            self._admission = AdmissionWait()
        else:
            # Resolved once: a pipeline that cannot batch gets one forward per request, and
            # holding requests open for company would only add latency.
            self._scheduler = Scheduler(
                self.config.max_num_seqs, None if batching else 1, self.config.priority_aging_s
            )
            self._admission = AdmissionWait.from_ms(self.config.request_batch_max_wait_ms if batching else 0)
        for lane in self._lanes:
            task = asyncio.create_task(self._run_lane(lane), name=f"diffbatch-engine-lane-{lane.index}")
            task.add_done_callback(self._on_loop_done)
            self._tasks.append(task)
        mode = {"step": "step-level batching", "request": "request-level batching"}[self.batching]
        steps = self._lanes[0].steps
        logger.info(
            "engine ready: %s, %d worker%s, max_num_seqs=%d, request_batch_max_wait_ms=%g%s",
            # A pipeline that cannot batch its own call may still step requests together.
            mode
            if batching or self.batching == "step"
            else "one request at a time (the pipeline cannot batch)",
            len(self._lanes),
            "" if len(self._lanes) == 1 else "s in parallel",
            self.config.max_num_seqs,
            self._admission.max_wait_s * 1000,
            f", max_step_tokens={steps.max_step_cost}" if steps is not None else "",
        )

    def _fit_to_profile(self) -> None:
        """Lower `max_num_seqs` and `max_step_tokens` to what the profile run fitted (each
        worker profiled its own device; the tightest holds for all: one limit per engine).
        Before the schedulers are made, which take them from `self.config`."""
        self.profile = ProfileResult.tightest(self._profiles)
        profile = self.profile
        if profile is None or profile.state != "measured" or profile.max_num_seqs is None:
            return
        tokens = profile.max_step_tokens
        lowered = replace(
            self.config,
            max_num_seqs=min(self.config.max_num_seqs, profile.max_num_seqs),
            max_step_tokens=tokens
            if self.config.max_step_tokens is None or tokens is None
            else min(tokens, self.config.max_step_tokens),
        )
        if lowered != self.config:
            logger.info(
                "the profile run lowered max_num_seqs %d -> %d, max_step_tokens %s -> %s",
                self.config.max_num_seqs,
                lowered.max_num_seqs,
                self.config.max_step_tokens,
                lowered.max_step_tokens,
            )
        self.config = lowered

    async def _start_executors(self) -> PipelineSpec:
        """Start every lane's executor at once; if one cannot start, none stays running."""
        started = await asyncio.gather(
            *(
                lane.executor.start(on_progress=self._on_progress, on_partial=self._route_partial)
                for lane in self._lanes
            ),
            return_exceptions=True,
        )
        failures = [result for result in started if isinstance(result, BaseException)]
        if failures:
            await asyncio.gather(*(lane.executor.shutdown() for lane in self._lanes), return_exceptions=True)
            raise failures[0]
        profiles = (getattr(spec, "profile_result", None) for spec in started)
        self._profiles = [p for p in profiles if isinstance(p, ProfileResult)]
        return started[0]  # type: ignore[return-value]  # every lane serves the same model

    def _step_budget(self, spec: PipelineSpec) -> int:
        """Compute allowed in one step: as configured, or `max_num_seqs` requests of the
        model's default shape (so at that shape the image bound is the one that binds)."""
        if self.config.max_step_tokens is not None:
            return self.config.max_step_tokens
        default = GenerationRequest.create("", SamplingParams())
        default = default.with_params(replace(spec.resolve(default), seed=0))
        return self.config.max_num_seqs * spec.step_cost(default)

    async def stop(self) -> None:
        for lane in self._lanes:
            lane.attention.set()
            lane.interrupt.set()
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        for task in tasks:
            # A loop that died earlier has logged why (`_on_loop_done`); stopping goes on.
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for request_id in list(self._futures):
            self._end(request_id, EngineNotRunningError("the server is shutting down"))
        await asyncio.gather(*(lane.executor.shutdown() for lane in self._lanes))

    def _on_progress(self, request_ids: list[str], done: int, total: int) -> None:
        for request_id in request_ids:
            self._work.progress(request_id, done)
        for observer in self.observers:
            observer.on_progress(request_ids, done, total)

    def _route_partial(self, partial: PartialImage) -> None:
        queue = self._partials.get(partial.request_id)
        if queue is not None:  # else the request has ended meanwhile
            queue.put_nowait(partial)

    def _on_loop_done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() or task.exception() is None:
            return
        # A bug in the loop must not leave callers waiting forever.
        exc = task.exception()
        self.failure = f"the engine loop died: {type(exc).__name__}: {exc}"
        logger.error("engine loop died; every request in flight gets 503", exc_info=exc)
        for request_id in list(self._futures):
            self._end(request_id, EngineNotRunningError("the engine stopped unexpectedly"))

    async def generate(self, request: GenerationRequest) -> RequestOutput:
        """Admit `request`, wait for its own result, and return it (or raise why not)."""
        return await self.submit(request).result()

    async def prepare_inputs(self, request: GenerationRequest) -> GenerationRequest:
        """Before `submit`, for requests with inputs (`has_inputs`): reduce them to what the
        model will use (`Pipeline.reduce_inputs`) and digest them, off the event loop, so a
        queued request holds only that and admission hashes nothing large."""
        spec = self._spec
        if spec is None or not request.has_inputs:
            return request
        return await asyncio.to_thread(prepared_inputs, spec, request)

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
