"""`AsyncEngine`: admits requests, runs the engine loop, and resolves each request's future.

The loop is one asyncio task: wait for work → schedule (a `RequestBatch` in request-level
batching, a `StepPlan` in step-level) → execute it off the event loop → route each
outcome by `request_id`. Only what one unit of work is changes between the two modes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import replace

from engine.admission import AdmissionWait
from engine.config import EngineConfig
from engine.errors import (
    DuplicateRequestError,
    EngineNotRunningError,
    QueueFullError,
    RequestAbortedError,
    as_engine_error,
)
from engine.executor import Executor, PipelineSpec
from engine.forward import BatchOutput
from engine.handle import RequestHandle
from engine.inputs import InputLedger, prepared_inputs
from engine.request import (
    GenerationRequest,
    PartialImage,
    RequestBatch,
    RequestOutput,
    SamplingParams,
    draw_seed,
)
from engine.scheduler import Scheduler
from engine.stats import EngineObserver, EngineStats
from engine.step_scheduler import StepPlan, StepScheduler, work_ids

logger = logging.getLogger(__name__)


class AsyncEngine:
    def __init__(self, executor: Executor, config: EngineConfig | None = None) -> None:
        self.config = config or EngineConfig()
        self.stats = EngineStats()
        self.observers: list[EngineObserver] = []
        self._executor = executor
        self._spec: PipelineSpec | None = None
        self._scheduler: Scheduler | StepScheduler = Scheduler(self.config.max_num_seqs)
        self.batching = self.config.batching
        self._admission = AdmissionWait.from_ms(self.config.request_batch_max_wait_ms)
        self._futures: dict[str, asyncio.Future[RequestOutput]] = {}
        self._partials: dict[str, asyncio.Queue[PartialImage]] = {}
        self._wakeup = asyncio.Event()
        # Set when the step scheduler has news (an arrival, an abort): the executor, which
        # keeps stepping while nothing changes, comes back at the next step boundary.
        self._attention = executor.new_flag()
        # Request mode: set when every request of the running batch is aborted (or the engine
        # stops), so the forward stops at its next denoising step instead of running for nobody.
        self._interrupt = executor.new_flag()
        self._running_batch: RequestBatch | None = None
        self._inputs = InputLedger(self.config.max_input_bytes)
        self._loop_task: asyncio.Task[None] | None = None
        # Why the engine stopped serving on its own (its loop died), for /health.
        self.failure: str | None = None

    @property
    def executor(self) -> Executor:
        return self._executor

    @property
    def unavailable(self) -> str | None:
        """Why the executor cannot run work just now (its worker process is restarting)."""
        return self._executor.health()

    @property
    def is_running(self) -> bool:
        return self._loop_task is not None and not self._loop_task.done()

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
        return self._scheduler

    async def start(self) -> None:
        spec = await self._executor.start(on_progress=self._on_progress, on_partial=self._route_partial)
        self._spec = spec
        batching = bool(spec.supports_request_batch)
        self.batching = self.config.batching
        if self.batching == "step" and not spec.supports_step_batch:
            logger.warning("this pipeline cannot step requests together; using request-level batching")
            self.batching = "request"
        if self.batching == "step":
            # Requests join between steps, so holding them at admission never pays.
            self._scheduler = StepScheduler(self.config.max_num_seqs, self._step_budget(spec))
            self._admission = AdmissionWait()
        else:
            # Resolved once: a pipeline that cannot batch gets one forward per request, and
            # holding requests open for company would only add latency.
            self._scheduler = Scheduler(self.config.max_num_seqs, None if batching else 1)
            self._admission = AdmissionWait.from_ms(self.config.request_batch_max_wait_ms if batching else 0)
        self._loop_task = asyncio.create_task(self._run_loop(), name="diffbatch-engine-loop")
        self._loop_task.add_done_callback(self._on_loop_done)
        mode = {"step": "step-level batching", "request": "request-level batching"}[self.batching]
        logger.info(
            "engine ready: %s, max_num_seqs=%d, request_batch_max_wait_ms=%g%s",
            mode if batching else "one request at a time (the pipeline cannot batch)",
            self.config.max_num_seqs,
            self._admission.max_wait_s * 1000,
            f", max_step_tokens={self._scheduler.max_step_cost}"
            if isinstance(self._scheduler, StepScheduler)
            else "",
        )

    def _step_budget(self, spec: PipelineSpec) -> int:
        """Compute allowed in one step: as configured, or `max_num_seqs` requests of the
        model's default shape (so at that shape the image bound is the one that binds)."""
        if self.config.max_step_tokens is not None:
            return self.config.max_step_tokens
        default = GenerationRequest.create("", SamplingParams())
        default = default.with_params(replace(spec.resolve(default), seed=0))
        return self.config.max_num_seqs * spec.step_cost(default)

    async def stop(self) -> None:
        self._attention.set()
        self._interrupt.set()
        task, self._loop_task = self._loop_task, None
        if task is not None:
            task.cancel()
            # A loop that died earlier has logged why (`_on_loop_done`); stopping goes on.
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for request_id in list(self._futures):
            self._end(request_id, EngineNotRunningError("the server is shutting down"))
        await self._executor.shutdown()

    def _on_progress(self, request_ids: list[str], done: int, total: int) -> None:
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
        """Before `submit`, for requests with input images: reduce them to what the model will
        use (`Pipeline.reduce_inputs`) and digest them, off the event loop, so a queued
        request holds only that and admission hashes nothing large."""
        spec = self._spec
        if spec is None or not request.input_images:
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
        self._wakeup.set()
        self._attention.set()
        return RequestHandle(request, future, partials, self.abort)

    def abort(self, request_id: str, error: Exception | None = None) -> bool:
        """Abort a waiting or running request; False if the engine does not hold it. Its
        caller gets `error` (by default `RequestAbortedError`)."""
        if not self._scheduler.has_request(request_id):
            return False
        was_waiting = self._scheduler.abort(request_id)
        self._attention.set()
        self.stats.requests_aborted += 1
        for observer in self.observers:
            observer.on_abort(request_id)
        logger.info("request %s aborted while %s", request_id, "waiting" if was_waiting else "running")
        self._end(request_id, error or RequestAbortedError(f"request {request_id} was aborted"))
        batch = self._running_batch
        if (
            batch is not None
            and not self._interrupt.is_set()
            and not any(self._scheduler.has_request(rid) for rid in batch.request_ids)
        ):
            logger.info("every request of the running batch is aborted: interrupting it")
            self._interrupt.set()
        return True

    def abort_all(self, error: Exception) -> int:
        """End every request the engine holds with `error` (shutdown: time is up); the engine
        keeps running. Returns how many there were."""
        return sum(self.abort(request_id, error) for request_id in list(self._futures))

    def _admit(self, request: GenerationRequest) -> GenerationRequest:
        if not self.is_running or self._spec is None:
            raise EngineNotRunningError("the engine is not running")
        if self._scheduler.has_request(request.request_id):
            raise DuplicateRequestError(request.request_id)
        if self._scheduler.num_waiting >= self.config.max_queue_len:
            raise QueueFullError(self.config.max_queue_len, self._retry_after_s())
        params = self._spec.resolve(request)
        if params.seed is None:
            params = replace(params, seed=draw_seed())
        self._spec.validate(params)
        self._spec.validate_inputs(len(request.input_images), request.mask is not None)
        request = request.with_params(params)
        self._inputs.hold(request, self.config.max_queue_len, self._retry_after_s())
        if isinstance(self._scheduler, StepScheduler):
            self._scheduler.add(request, self._spec.step_key(request), self._spec.step_cost(request))
        else:
            self._scheduler.add(request, self._spec.batch_key(request))
        return request

    def _retry_after_s(self) -> float:
        batches_ahead = self._scheduler.num_waiting / self.config.max_num_seqs
        return max(1.0, batches_ahead * self.stats.mean_forward_s)

    async def _run_loop(self) -> None:
        while True:
            await self._wait_for_work()
            work = self._schedule()
            if work is None:
                continue
            joined = work if isinstance(work, RequestBatch) else RequestBatch(work.key, work.join)
            if joined.requests:
                now = time.monotonic()
                for observer in self.observers:
                    observer.on_batch_start(joined, now)
            try:
                output = await self._execute(work)
            except Exception as exc:
                logger.exception("executor failed on a batch of %d requests", len(work_ids(work)))
                output = BatchOutput(errors={rid: exc for rid in work_ids(work)})
            self._finish(work, output)

    def _schedule(self) -> RequestBatch | StepPlan | None:
        if isinstance(self._scheduler, StepScheduler):
            self._attention.clear()  # before scheduling: later news must stop the steps
            return self._scheduler.schedule()
        return self._scheduler.next_batch()

    async def _execute(self, work: RequestBatch | StepPlan) -> BatchOutput:
        if isinstance(work, StepPlan):
            return await self._executor.execute_step(work, self._attention)
        self._interrupt.clear()
        self._running_batch = work
        try:
            return await self._executor.execute_batch(work, self._interrupt)
        finally:
            self._running_batch = None

    async def _wait_for_work(self) -> None:
        """Return once work should be scheduled: there is some, and the admission wait is over."""
        while True:
            scheduler = self._scheduler
            if isinstance(scheduler, StepScheduler):
                if scheduler.has_work():
                    return
            elif scheduler.num_waiting > 0:
                remaining = self._admission_remaining(scheduler)
                if remaining <= 0:
                    return
                self._wakeup.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(remaining):
                        await self._wakeup.wait()
                continue
            self._wakeup.clear()
            await self._wakeup.wait()

    def _admission_remaining(self, scheduler: Scheduler) -> float:
        head_arrival = scheduler.head_arrival()
        last_arrival = scheduler.head_last_arrival()
        assert head_arrival is not None and last_arrival is not None
        return self._admission.remaining(
            time.monotonic(),
            num_running=scheduler.num_running,
            batch_full=scheduler.head_batch_is_full(),
            head_arrival=head_arrival,
            last_arrival=last_arrival,
        )

    def _finish(self, work: RequestBatch | StepPlan, output: BatchOutput) -> None:
        self.stats.record_forwards(output.forwards)
        for observer in self.observers:
            for record in output.forwards:
                observer.on_forward(record)
            for request_id, (done, total) in output.progress.items():
                observer.on_progress([request_id], done, total)
        for partial in output.partials:  # before the outputs: a preview never follows its image
            self._route_partial(partial)
        if isinstance(self._scheduler, StepScheduler):
            self._scheduler.release(output.decoding)
            owed = self._scheduler.finish([*output.outputs, *output.errors])
        else:
            assert isinstance(work, RequestBatch)
            owed = self._scheduler.finish(work)  # aborted requests are not owed
            self._learn_memory(work, output)
        for request_id in owed:
            result = output.outputs.get(request_id)
            if result is not None:
                self.stats.requests_finished += 1
                self._end(request_id, result)
                continue
            self.stats.requests_failed += 1
            error = output.errors.get(request_id) or RuntimeError("the pipeline returned no output")
            self._end(request_id, as_engine_error(error))

    def _learn_memory(self, batch: RequestBatch, output: BatchOutput) -> None:
        """A batch that ran out of memory was split and retried: batches of its key are
        capped from now on, so the next one of that shape does not run out again."""
        if isinstance(self._scheduler, Scheduler):
            news = self._scheduler.learn_memory(batch.key, output.forwards)
            if news is not None:
                ran_out, message = news
                logger.log(logging.WARNING if ran_out else logging.INFO, message)

    def _end(self, request_id: str, outcome: RequestOutput | Exception) -> None:
        """Resolve a request's future exactly once; a done or cancelled one is left alone."""
        self._inputs.release(request_id)
        self._partials.pop(request_id, None)
        future = self._futures.pop(request_id, None)
        if future is None or future.done():
            return
        if isinstance(outcome, Exception):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)
