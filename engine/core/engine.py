"""`AsyncEngine`: admits requests, runs the engine loop, and resolves each request's future.

The loop is one asyncio task per lane (a worker: one executor, `engine.core.lanes`): wait for
work → schedule (a `RequestBatch` in request-level batching, a `StepPlan` in step-level) →
execute it off the event loop → route each outcome by `request_id`. Only what one unit of
work is changes between the two modes; with `--data-parallel-size N` there are N lanes
whose work runs in parallel (how requests reach them: `engine.core.lanes`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence

from engine.core.admission import AdmissionWait
from engine.core.admission_queue import AdmissionQueue
from engine.core.config import EngineConfig
from engine.core.deadline_guard import DeadlineGuard
from engine.core.engine_limits import fitted_to_profile, step_budget
from engine.core.inputs import InputLedger, prepared_inputs
from engine.core.lane_loop import LaneLoops
from engine.core.lanes import Lane
from engine.core.stats import EngineObserver, EngineStats
from engine.errors import (
    EngineNotRunningError,
)
from engine.executor.abstract import Executor
from engine.request import (
    BatchKey,
    GenerationRequest,
    PartialImage,
    RequestOutput,
)
from engine.sched.deadline_admission import HeldWork
from engine.sched.scheduler import Scheduler
from engine.sched.step_groups import WorkPace
from engine.sched.step_scheduler import StepScheduler
from engine.spec import PipelineSpec
from engine.worker.profile_run import ProfileResult

logger = logging.getLogger(__name__)


class AsyncEngine(AdmissionQueue, LaneLoops, DeadlineGuard):
    """`executor` is one executor, or one per data-parallel worker (all serving the same
    model, each on its own device). A request's life from admission to its end is
    `AdmissionQueue` (first: it implements what `LaneLoops` only declares); the loops that
    run the work are `LaneLoops`; admission by deadline is `DeadlineGuard`."""

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
        # What the profile run at start found (`engine.worker.profile_run`), for /health and /metrics;
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
        # Before the schedulers are made, which take the limits from `self.config`.
        self.profile = ProfileResult.tightest(self._profiles)
        self.config = fitted_to_profile(self.config, self.profile)
        batching = bool(spec.supports_request_batch)
        self.batching = self.config.batching
        if self.batching == "step" and not spec.supports_step_batch:
            logger.warning("this pipeline cannot step requests together; using request-level batching")
            self.batching = "request"
        if self.batching == "step":
            # Requests join between steps, so holding them at admission never pays.
            budget = step_budget(self.config, spec)
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
