"""Admission by deadline through the engine in both batching modes, with fake pipelines in a
real executor thread. The step time is taught by hand (as a finished forward would teach
it), so nothing depends on how fast this machine runs the fakes."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest

from engine.core.config import Batching, EngineConfig
from engine.core.engine import AsyncEngine
from engine.errors import DeadlineUnmeetableError
from engine.executor.thread_executor import ThreadExecutor
from engine.outputs import ForwardRecord
from engine.request import GenerationRequest
from engine.sched.deadline_admission import HEADROOM
from tests.engine.core.test_priority_engine import release
from tests.engine.fakes import FakePipeline, FakeStepPipeline, make_request
from tests.polling import until


def due_in(request_id: str, seconds: float, steps: int = 1) -> GenerationRequest:
    return replace(make_request(request_id, steps=steps), deadline=time.monotonic() + seconds)


def pipeline_for(batching: Batching) -> FakePipeline:
    if batching == "step":
        step = FakeStepPipeline()
        step.permits = threading.Semaphore(0)
        return step
    pipeline = FakePipeline()
    pipeline.gate = threading.Event()
    return pipeline


@pytest.mark.parametrize("batching", ["request", "step"])
@pytest.mark.parametrize("admission", [True, False])
async def test_a_deadline_the_work_ahead_would_miss_is_refused_at_once_never_queued(
    batching: Batching, admission: bool
) -> None:
    pipeline = pipeline_for(batching)
    config = EngineConfig(1, batching=batching, deadline_admission=admission)
    engine = AsyncEngine(ThreadExecutor(lambda: pipeline), config)
    await engine.start()
    handles = []
    try:
        handles.append(engine.submit(make_request("long", steps=50)))
        await until(lambda: engine.num_waiting == 0, "the long request runs")
        long_work = engine._work.left("long")
        assert long_work is not None
        # As if forwards (after the warm-up) took 0.2 s a step of the long request: 10 s of work ahead.
        record = ForwardRecord(num_requests=1, num_images=1, seconds=0.0, ok=True)
        for _ in range(2):  # the warm-up (a first request done), then a unit measured
            engine._work.rates.learn(long_work.key, [record], long_work.cost, seconds=0.2, finished=True)
        if admission:
            with pytest.raises(DeadlineUnmeetableError, match="deadline is in") as refused:
                engine.submit(due_in("hurried", 2.0))
            # 10 s ahead, 0.2 s its own, stretched by HEADROOM, less the 2 s it has.
            assert refused.value.retry_after_s == pytest.approx(HEADROOM * 10.2 - 2.0, abs=0.5)
            assert refused.value.retry
            assert engine.num_waiting == 0 and engine.stats.requests_aborted == 0  # never queued
        else:
            handles.append(engine.submit(due_in("hurried", 600.0)))
        handles.append(engine.submit(due_in("patient", 600.0)))  # 10 s ahead fits in 600
        assert engine.num_waiting == len(handles) - 1
    finally:
        release(pipeline)
        for handle in handles:
            await handle.result()
        await engine.stop()


async def test_step_mode_counts_the_work_ahead_on_the_newcomers_own_lane() -> None:
    """With two workers each holding 10 s of work, a newcomer waits for its own lane's 10 s
    (step-mode requests stay on the lane they join), not half of the 20 s."""
    pipelines = [pipeline_for("step"), pipeline_for("step")]
    executors = [ThreadExecutor(lambda p=p: p) for p in pipelines]  # type: ignore[misc]
    engine = AsyncEngine(executors, EngineConfig(1, batching="step"))
    await engine.start()
    handles = []
    try:
        for name in ("long-a", "long-b"):  # one per lane (an idle lane is chosen first)
            handles.append(engine.submit(make_request(name, steps=50)))
        lanes = [engine._queue.lane_of(name) for name in ("long-a", "long-b")]
        assert {lane.index for lane in lanes if lane is not None} == {0, 1}
        await until(lambda: engine.num_waiting == 0, "both run")
        work = engine._work.left("long-a")
        assert work is not None
        record = ForwardRecord(num_requests=1, num_images=1, seconds=0.0, ok=True)
        for _ in range(2):  # the warm-up (a first request done), then a unit measured
            engine._work.rates.learn(work.key, [record], work.cost, seconds=0.2, finished=True)
        # 10 s ahead on its lane + 0.2 s its own, with headroom: past a 12 s deadline.
        with pytest.raises(DeadlineUnmeetableError):
            engine.submit(due_in("hurried", 12.0))
        handles.append(engine.submit(due_in("patient", 30.0)))
    finally:
        for pipeline in pipelines:
            release(pipeline)
        for handle in handles:
            await handle.result()
        await engine.stop()


async def test_step_mode_counts_a_running_request_as_rows_stepping_beside_the_newcomer() -> None:
    """A second request in flight does not overshoot a deadline of twice the alone time:
    the newcomer steps beside the running one, each step of the pair costing a little more
    than a step alone (`engine.sched.step_admission`), not after it."""
    pipeline = pipeline_for("step")
    engine = AsyncEngine(ThreadExecutor(lambda: pipeline), EngineConfig(8, batching="step"))
    await engine.start()
    handles = []
    try:
        handles.append(engine.submit(make_request("first", steps=4)))
        await until(lambda: engine.num_waiting == 0, "the first request runs")
        work = engine._work.left("first")
        assert work is not None
        record = ForwardRecord(num_requests=1, num_images=1, seconds=0.0, ok=True)
        for _ in range(2):  # the warm-up, then a step alone: 1 s
            engine._work.rates.learn(work.key, [record], work.cost, seconds=1.0, finished=True)
        engine._work.groups.learn(work.key, work.cost, 1.0)
        engine._work.groups.learn(work.key, 2 * work.cost, 1.2)  # a step of two rows
        # 4 steps of 1.2 s (x HEADROOM: 5.8 s) within 8 s; one after the other would be 9.6 s.
        handles.append(engine.submit(due_in("second", 8.0, steps=4)))
        # With every seat taken (8 running), a newcomer waits for one, in groups of 8 rows.
        for i in range(6):
            handles.append(engine.submit(make_request(f"filler-{i}", steps=40)))
        with pytest.raises(DeadlineUnmeetableError):
            engine.submit(due_in("third", 8.0, steps=4))
    finally:
        release(pipeline)
        for handle in handles:
            await handle.result()
        await engine.stop()
