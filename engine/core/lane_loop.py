"""The engine's loops: one asyncio task per lane (`engine.core.lanes`) that waits for work,
schedules it (a `RequestBatch` in request-level batching, a `StepPlan` in step-level),
runs it on the lane's executor off the event loop, and settles what came back.

`AsyncEngine` (`engine.core.engine`) holds one `LaneLoops` beside its `AdmissionQueue`: the
loops take work from the schedulers the queue fills and hand each request's outcome back
to it (`end`, or `retry` after its worker died).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from engine.core.admission import AdmissionWait
from engine.core.admission_queue import AdmissionQueue
from engine.core.lanes import Lane, workers_up
from engine.core.stats import EngineObserver, EngineStats, WorkSpan
from engine.errors import as_engine_error
from engine.outputs import BatchOutput
from engine.request import RequestBatch
from engine.sched.deadline_admission import HeldWork
from engine.sched.scheduler import Scheduler
from engine.sched.step_plan import StepPlan, work_ids

logger = logging.getLogger("engine.core.engine")

# How often a lane whose worker is down looks whether it is back (request mode).
_DOWN_LANE_POLL_S = 0.5


class LaneLoops:
    """Runs each lane's loop (`run`) over the work `queue` admits; `work` learns the step
    times and progress of what ran; `admission` is request mode's admission wait."""

    def __init__(
        self,
        queue: AdmissionQueue,
        work: HeldWork,
        stats: EngineStats,
        observer: EngineObserver,
        *,
        admission: AdmissionWait,
        lanes: list[Lane],
    ) -> None:
        self._queue = queue
        self._work = work
        self._stats = stats
        self._observer = observer
        self._admission = admission
        self._lanes = lanes

    async def run(self, lane: Lane) -> None:
        """`lane`'s loop, until cancelled."""
        while True:
            await self._wait_for_work(lane)
            work = self._schedule(lane)
            if work is None:
                continue
            joined = work if isinstance(work, RequestBatch) else RequestBatch(work.key, work.join)
            started = time.monotonic()
            self._queue.timelines.scheduled(work, lane.index, started)
            if joined.requests:
                self._observer.on_batch_start(joined, started)
            lane.running = work
            try:
                output = await self._execute(lane, work)
            except Exception as exc:
                # What it held is unknown: the work fails, and in step mode so do the
                # requests decoded beside the steps (their outputs would have come with it).
                failed = [*work_ids(work), *(lane.steps.decoding_ids() if lane.steps is not None else ())]
                logger.exception("executor failed on a batch of %d requests", len(failed))
                output = BatchOutput(errors=dict.fromkeys(failed, exc))
            finally:
                lane.running = None
            ended = time.monotonic()
            lane.busy_s += ended - started
            lane.units += 1
            self._stats.record_span(WorkSpan(lane.index, started, ended, len(work_ids(work))))
            self._learn_rates(work, output, ended - started)
            self._finish(lane, work, output)
            self._queue.wakeup.set()  # request mode: the other lanes see the queue anew

    def _schedule(self, lane: Lane) -> RequestBatch | StepPlan | None:
        if lane.steps is not None:
            lane.attention.clear()  # before scheduling: later news must stop the steps
            return lane.steps.schedule()
        return self._queue.scheduler.next_batch()

    async def _execute(self, lane: Lane, work: RequestBatch | StepPlan) -> BatchOutput:
        if isinstance(work, StepPlan):
            return await lane.executor.execute_step(work, lane.attention)
        lane.interrupt.clear()
        return await lane.executor.execute_batch(work, lane.interrupt)

    async def _wait_for_work(self, lane: Lane) -> None:
        """Return once `lane` should schedule work: there is some for it, and in request
        mode the admission wait is over."""
        while True:
            steps = lane.steps
            if steps is not None:
                if not lane.healthy and workers_up(self._lanes):
                    self._hand_over(lane)
                elif steps.has_work():
                    return
            elif self._queue.scheduler.num_waiting > 0 and self._may_pull(lane):
                remaining = self._admission_remaining(self._queue.scheduler)
                if remaining <= 0:
                    return
                self._queue.wakeup.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(remaining):
                        await self._queue.wakeup.wait()
                continue
            self._queue.wakeup.clear()
            # A lane whose worker is down is not woken when it comes back: it looks again soon.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(None if lane.healthy else _DOWN_LANE_POLL_S):
                    await self._queue.wakeup.wait()

    def _hand_over(self, lane: Lane) -> None:
        """Step mode: a lane whose worker is down (it crashed: it holds no running request)
        gives the requests waiting on it, in arrival order, to lanes that are up, as request
        mode's shared queue does, instead of holding them until its worker is back (that
        can take `--worker-start-timeout-s`). If every lane is down, they stay."""
        assert lane.steps is not None
        waiting = lane.steps.take_waiting()
        if waiting:
            logger.warning(
                "worker %d is down: its %d waiting requests go to the others", lane.index, len(waiting)
            )
        for request in waiting:
            self._queue.enqueue(request, avoid=lane)

    def _may_pull(self, lane: Lane) -> bool:
        """Request mode: a lane whose worker is down leaves the queue to lanes that are up
        (if every one is down, its executor holds the batch until its worker is back)."""
        return lane.healthy or not workers_up(self._lanes)

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

    def _finish(self, lane: Lane, work: RequestBatch | StepPlan, output: BatchOutput) -> None:
        self._stats.record_forwards(output.forwards)
        self._stats.record_decodes(output.decodes)
        self._stats.record_out_of_memory(output)
        self._stats.record_prompt_cache(lane.index, output)
        self._queue.timelines.record(output, stepping=lane.steps is not None)
        for record in output.forwards:
            self._observer.on_forward(record)
        for decode in output.decodes:
            self._observer.on_decode(decode)
        for moderation in output.moderations:
            self._observer.on_moderation(moderation)
        for request_id, (done, total) in output.progress.items():
            self._observer.on_progress([request_id], done, total)
        for partial in output.partials:  # before the outputs: a preview never follows its image
            self._queue.route_partial(partial)
        if lane.steps is not None:
            self._learn_step_memory(lane, output)
            lane.steps.release(output.decoding)
            lane.steps.note_progress(output.progress)
            owed = lane.steps.finish([*output.outputs, *output.errors])
        else:
            assert isinstance(work, RequestBatch)
            owed = self._queue.scheduler.finish(work)  # aborted requests are not owed
            self._learn_memory(work, output)
        for request_id in owed:
            result = output.outputs.get(request_id)
            if result is not None:
                self._stats.requests_finished += 1
                self._queue.end(request_id, result)
                continue
            error = output.errors.get(request_id) or RuntimeError("the pipeline returned no output")
            if self._queue.retry(request_id, error, lane):
                continue
            self._stats.requests_failed += 1
            self._queue.end(request_id, as_engine_error(error))

    def _learn_rates(self, work: RequestBatch | StepPlan, output: BatchOutput, seconds: float) -> None:
        """Admission by deadline: the time of a step learnt from a unit of work that took
        `seconds`, and how far each request has got (before `_finish` releases any)."""
        if isinstance(work, RequestBatch):
            ids, images = work.request_ids, work.num_images
        else:
            ids, held = list(work.step), self._queue.held
            images = sum(held[rid].params.n for rid in ids if rid in held)
        self._work.learn(
            work.key, ids, images, output.forwards, seconds=seconds, finished=bool(output.outputs)
        )
        for request_id, (done, _) in output.progress.items():
            self._work.progress(request_id, done)

    def _learn_step_memory(self, lane: Lane, output: BatchOutput) -> None:
        """Step mode: a stage that ran out of memory was retried in halves; the lane's step
        budget is lowered to what fitted, so later groups do not run out again."""
        assert lane.steps is not None
        news = lane.steps.learn_memory(output.fits)
        if news is not None:
            ran_out, message = news
            logger.log(logging.WARNING if ran_out else logging.INFO, "worker %d: %s", lane.index, message)

    def _learn_memory(self, batch: RequestBatch, output: BatchOutput) -> None:
        """A batch that ran out of memory was split and retried: batches of its key are
        capped from now on, so the next one of that shape does not run out again."""
        if isinstance(self._queue.scheduler, Scheduler):
            news = self._queue.scheduler.learn_memory(batch.key, output.forwards)
            if news is not None:
                ran_out, message = news
                logger.log(logging.WARNING if ran_out else logging.INFO, message)
