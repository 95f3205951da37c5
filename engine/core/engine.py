"""`AsyncEngine`: admits requests, runs the engine loop, and resolves each request's future.

The loop is one asyncio task per lane (a worker: one executor, `engine.core.lanes`): wait for
work → schedule (a `RequestBatch` in request-level batching, a `StepPlan` in step-level) →
execute it off the event loop → route each outcome by `request_id`. Only what one unit of
work is changes between the two modes; with `--data-parallel-size N` there are N lanes
whose work runs in parallel (how requests reach them: `engine.core.lanes`).

The engine holds its collaborators, as vLLM's `EngineCore` holds its scheduler and
executor: the `AdmissionQueue` (a request's life from admission to its end), the
`LaneLoops` (each lane's loop) and the `DeadlineGuard` (admission by deadline), which share
`HeldWork` (what each held request still has to run).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Sequence

from engine.core.admission import AdmissionWait
from engine.core.admission_queue import AdmissionQueue
from engine.core.config import EngineConfig
from engine.core.deadline_guard import DeadlineGuard
from engine.core.engine_limits import fitted_to_profile, step_budget
from engine.core.handle import RequestHandle
from engine.core.inputs import prepared_inputs
from engine.core.lane_counts import lane_counts, step_counter, worker_counts
from engine.core.lane_loop import LaneLoops
from engine.core.lanes import Lane, WorkerHealth, worker_health, workers_up
from engine.core.stats import EngineObserver, EngineStats, Observers
from engine.errors import EngineNotRunningError
from engine.executor.abstract import Executor, Loaded
from engine.request import BatchKey, GenerationRequest, RequestOutput
from engine.sched.deadline_admission import HeldWork
from engine.sched.scheduler import Scheduler
from engine.sched.step_groups import WorkPace
from engine.sched.step_scheduler import StepScheduler
from engine.spec import PipelineSpec
from engine.worker.pipeline import LoadReport
from engine.worker.profile_run import ProfileResult

logger = logging.getLogger(__name__)


class AsyncEngine:
    """`executor` is one executor, or one per data-parallel worker (all serving the same
    model, each on its own device)."""

    def __init__(self, executor: Executor | Sequence[Executor], config: EngineConfig | None = None) -> None:
        self.config = config or EngineConfig()
        self.stats = EngineStats()
        # Every collaborator tells this one; `observers` may be replaced (a model set shares one list).
        self._observers = Observers()
        executors = list(executor) if isinstance(executor, Sequence) else [executor]
        if not executors:
            raise ValueError("an engine needs at least one executor")
        # Flags are made before the executors start (a worker process gets them at spawn).
        self._lanes = [Lane(i, ex, ex.new_flag(), ex.new_flag()) for i, ex in enumerate(executors)]
        self._spec: PipelineSpec | None = None
        # What each held request still has to run, and the step rates learnt (admission by deadline).
        self._work = HeldWork()
        self._queue = AdmissionQueue(
            self._lanes,
            self._work,
            self.stats,
            self._observers,
            max_queue_len=self.config.max_queue_len,
            max_input_bytes=self.config.max_input_bytes,
            retry_on_worker_crash=self.config.retry_on_worker_crash,
            scheduler=Scheduler(self.config.max_num_seqs, aging_s=self.config.priority_aging_s),
            batching=self.config.batching,
        )
        self._tasks: list[asyncio.Task[None]] = []
        # Why the engine stopped serving on its own (its loop died), for /health.
        self.failure: str | None = None
        # What the profile run at start found (`engine.worker.profile_run`), for /health and /metrics;
        # None when no executor was asked to profile.
        self.profile: ProfileResult | None = None
        # What the composition root measured of the pipeline as it loaded (the first lane's).
        self._report = LoadReport()

    @property
    def observers(self) -> list[EngineObserver]:
        """Told what the engine does, as it happens (metrics)."""
        return self._observers.observers

    @observers.setter
    def observers(self, observers: list[EngineObserver]) -> None:
        self._observers.observers = observers

    @property
    def queue(self) -> AdmissionQueue:
        """Every request from admission to its end (for tests)."""
        return self._queue

    @property
    def batching(self) -> str:
        """ "step" or "request": as configured, until `start` resolves it for the pipeline."""
        return self._queue.batching

    @property
    def executor(self) -> Executor:
        """The first lane's executor (the only one without data parallelism)."""
        return self._lanes[0].executor

    @property
    def lanes(self) -> list[Lane]:
        return list(self._lanes)

    def worker_health(self) -> WorkerHealth:
        return worker_health(self._lanes)

    @property
    def workers_up(self) -> int:
        return workers_up(self._lanes)

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
        return self._queue.input_bytes

    @property
    def scheduler(self) -> Scheduler | StepScheduler:
        """Request mode: the shared queue; step mode: the first lane's step scheduler (the
        engine's `num_waiting` and `num_running` count every lane)."""
        steps = self._lanes[0].steps
        return steps if self.batching == "step" and steps is not None else self._queue.scheduler

    @property
    def spec(self) -> PipelineSpec | None:
        """What the served pipeline answers on the event loop (once started)."""
        return self._spec

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights the served pipeline holds, as measured when it loaded (0 until
        started, or when not measured)."""
        return self._report.weight_bytes

    @property
    def image_caps(self) -> dict[BatchKey, int]:
        return self._queue.scheduler.image_caps

    @property
    def out_of_memory_in_halves(self) -> dict[str, int]:
        return dict(self.stats.out_of_memory)

    @property
    def prompt_cache(self) -> dict[str, float]:
        return self.stats.prompt_cache_totals()

    @property
    def answers_by_replica(self) -> dict[str, int]:
        return {}  # the engine is here, not behind Ray Serve replicas

    async def engine_for(self, name: str | None, timeout_s: float | None = None) -> AsyncEngine:
        return self  # it serves one model

    def model_set_status(self) -> None:
        return None  # one model: its state is the engine's own

    def lane_counts(self) -> dict[str, tuple[float, int]]:
        return lane_counts(self._lanes)

    def worker_counts(self) -> Counter[str]:
        return worker_counts(self._lanes)

    def step_counter(self, name: str) -> int:
        return step_counter(self._lanes, name)

    @property
    def num_waiting(self) -> int:
        return self._queue.num_waiting

    @property
    def num_running(self) -> int:
        return self._queue.num_running

    @property
    def num_unfinished(self) -> int:
        return self._queue.num_unfinished

    async def start(self) -> None:
        loaded = await self._start_executors()
        spec = self._spec = loaded[0].spec  # every lane serves the same model
        self._report = loaded[0].report
        # Before the schedulers are made, which take the limits from `self.config`.
        self.profile = ProfileResult.tightest(
            [r.report.profile for r in loaded if r.report.profile is not None]
        )
        self.config = fitted_to_profile(self.config, self.profile)
        batching = bool(spec.supports_request_batch)
        mode = self.config.batching
        if mode == "step" and not spec.supports_step_batch:
            logger.warning("this pipeline cannot step requests together; using request-level batching")
            mode = "request"
        scheduler = self._queue.scheduler
        if mode == "step":
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
            admission = AdmissionWait()
        else:
            # Resolved once: a pipeline that cannot batch gets one forward per request, and
            # holding requests open for company would only add latency.
            scheduler = Scheduler(
                self.config.max_num_seqs, None if batching else 1, self.config.priority_aging_s
            )
            admission = AdmissionWait.from_ms(self.config.request_batch_max_wait_ms if batching else 0)
        guard = DeadlineGuard(
            self._work, enabled=self.config.deadline_admission, aging_s=self.config.priority_aging_s
        )
        self._queue.open(spec, guard, mode, scheduler)
        loops = LaneLoops(
            self._queue, self._work, self.stats, self._observers, admission=admission, lanes=self._lanes
        )
        for lane in self._lanes:
            task = asyncio.create_task(loops.run(lane), name=f"diffbatch-engine-lane-{lane.index}")
            task.add_done_callback(self._on_loop_done)
            self._tasks.append(task)
        self._log_ready(batching, admission)

    def _log_ready(self, batching: bool, admission: AdmissionWait) -> None:
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
            admission.max_wait_s * 1000,
            f", max_step_tokens={steps.max_step_cost}" if steps is not None else "",
        )

    async def _start_executors(self) -> list[Loaded]:
        """Start every lane's executor at once; if one cannot start, none stays running."""
        started = await asyncio.gather(
            *(
                lane.executor.start(on_progress=self._on_progress, on_partial=self._queue.route_partial)
                for lane in self._lanes
            ),
            return_exceptions=True,
        )
        failures = [result for result in started if isinstance(result, BaseException)]
        if failures:
            await asyncio.gather(*(lane.executor.shutdown() for lane in self._lanes), return_exceptions=True)
            raise failures[0]
        return [result for result in started if isinstance(result, Loaded)]

    async def stop(self) -> None:
        self._queue.close()
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
        self._queue.end_all(EngineNotRunningError("the server is shutting down"))
        await asyncio.gather(*(lane.executor.shutdown() for lane in self._lanes))

    def _on_progress(self, request_ids: list[str], done: int, total: int) -> None:
        for request_id in request_ids:
            self._work.progress(request_id, done)
        self._observers.on_progress(request_ids, done, total)

    def _on_loop_done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() or task.exception() is None:
            return
        # A bug in the loop must not leave callers waiting forever.
        exc = task.exception()
        self._queue.close()
        self.failure = f"the engine loop died: {type(exc).__name__}: {exc}"
        logger.error("engine loop died; every request in flight gets 503", exc_info=exc)
        self._queue.end_all(EngineNotRunningError("the engine stopped unexpectedly"))

    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Admit `request` now, raising at once if it is refused, and hand it to the caller,
        who owns it from here (see `RequestHandle`)."""
        return self._queue.submit(request)

    def abort(self, request_id: str, error: Exception | None = None) -> bool:
        """Abort a waiting or running request; False if the engine does not hold it."""
        return self._queue.abort(request_id, error)

    def abort_all(self, error: Exception) -> int:
        """End every request the engine holds with `error`; the engine keeps running."""
        return self._queue.abort_all(error)

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
