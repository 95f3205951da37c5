"""Each request's timeline (`engine.timeline`), as the engine hands it to its observers when
the request ends: its queue wait, the stages that ran it, the step groups it shared and its
preemptions, in both batching modes (fake pipelines in a real executor thread; a worker
process's timings are checked end to end, tests/e2e/test_traces.py)."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest

from engine.core.config import EngineConfig
from engine.core.engine import AsyncEngine
from engine.errors import ForwardError
from engine.executor.thread_executor import ThreadExecutor
from engine.timeline import RequestTimeline
from tests.engine.core.test_engine import RecordingObserver
from tests.engine.core.test_preemption_engine import prioritized, steps_of, take_steps
from tests.engine.fakes import FakePipeline, FakeStepPipeline, make_request
from tests.polling import until


async def started(pipeline: FakePipeline, config: EngineConfig) -> tuple[AsyncEngine, RecordingObserver]:
    engine = AsyncEngine(ThreadExecutor(lambda: pipeline), config)
    await engine.start()
    observer = RecordingObserver()
    engine.observers.append(observer)
    return engine, observer


def ended(observer: RecordingObserver, request_id: str) -> RequestTimeline:
    timeline, error = observer.ended[request_id]
    assert error is None
    assert timeline.scheduled is not None and timeline.ended is not None
    assert timeline.admitted <= timeline.scheduled <= timeline.ended
    return timeline


async def test_step_timelines_say_who_stepped_together_and_who_was_paused() -> None:
    pipeline = FakeStepPipeline()
    pipeline.permits = threading.Semaphore(0)
    engine, observer = await started(pipeline, EngineConfig(2, batching="step", preemption=True))
    try:
        # "low" steps alone, then beside "peer", then pauses for "high" (2 images: no room).
        low = engine.submit(prioritized("low", 10, steps=8))
        await take_steps(pipeline, 1)
        peer = engine.submit(prioritized("peer", 10, steps=2))
        while "peer" not in observer.ended:
            await take_steps(pipeline, 1)
        request = prioritized("high", 0, steps=2)
        high = engine.submit(replace(request, params=replace(request.params, n=2)))
        await take_steps(pipeline, 1)
        await until(lambda: steps_of(engine).num_paused == 1, "low pauses")
        assert pipeline.permits is not None
        pipeline.permits.release(100)
        for handle in (low, peer, high):
            await handle.result()
    finally:
        await engine.stop()
    asked = {"low": 8, "peer": 2, "high": 2}
    timelines = {rid: ended(observer, rid) for rid in asked}
    for request_id, timeline in timelines.items():
        steps, prepare, decode = timeline.steps, timeline.prepare, timeline.decode
        assert steps is not None and prepare is not None and decode is not None
        assert timeline.scheduled is not None and timeline.ended is not None
        assert timeline.scheduled <= prepare.started <= prepare.ended <= steps.started
        assert steps.started <= steps.ended <= decode.started <= decode.ended <= timeline.ended
        assert timeline.forward is None and timeline.worker == 0
        # What the pipeline itself saw: the groups each request stepped in.
        groups = [len(group) for group in pipeline.groups if request_id in group]
        assert steps.steps == len(groups) == asked[request_id]
        assert (steps.smallest, steps.largest) == (min(groups), max(groups))
        assert steps.mean_size == sum(groups) / len(groups)
    low_steps = timelines["low"].steps
    assert low_steps is not None and (low_steps.smallest, low_steps.largest) == (1, 2)
    assert timelines["low"].preemptions == 1
    assert timelines["peer"].preemptions == timelines["high"].preemptions == 0


async def test_request_timelines_say_the_batch_they_ran_in() -> None:
    pipeline = FakePipeline()
    pipeline.gate = threading.Event()
    engine, observer = await started(pipeline, EngineConfig(4, batching="request"))
    try:
        first = engine.submit(make_request("first"))
        await until(pipeline.started.is_set, "the first forward runs")
        rest = [engine.submit(make_request(f"r{i}")) for i in range(3)]
        await until(lambda: engine.num_waiting == 3, "three wait behind it")
        pipeline.gate.set()
        for handle in (first, *rest):
            await handle.result()
    finally:
        await engine.stop()
    assert pipeline.forwards == [["first"], ["r0", "r1", "r2"]]
    for request_id, size in (("first", 1), ("r0", 3), ("r2", 3)):
        timeline = ended(observer, request_id)
        forward = timeline.forward
        assert forward is not None and timeline.scheduled is not None and timeline.ended is not None
        assert timeline.scheduled <= forward.started <= forward.ended <= timeline.ended
        assert timeline.batch_size == size and timeline.steps is None and timeline.prepare is None
    # The three queued behind the first: their queue wait lasted as long as its forward.
    held = ended(observer, "r0")
    first_forward = ended(observer, "first").forward
    assert held.scheduled is not None and first_forward is not None
    assert held.scheduled >= first_forward.ended


async def test_a_failed_request_ends_with_its_error() -> None:
    engine, observer = await started(FakePipeline(), EngineConfig(4, batching="request"))
    try:
        with pytest.raises(ForwardError):
            await engine.generate(make_request("bad", prompt="please FAIL"))
    finally:
        await engine.stop()
    timeline, error = observer.ended["bad"]
    assert isinstance(error, ForwardError) and timeline.ended is not None
