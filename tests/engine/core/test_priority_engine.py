"""Priority through the engine in both batching modes, with fake pipelines in a real executor
thread: a request of a better priority submitted later runs before a worse one waiting."""

from __future__ import annotations

import threading
from dataclasses import replace

from engine.core.config import Batching, EngineConfig
from engine.core.engine import AsyncEngine
from engine.executor.thread_executor import ThreadExecutor
from engine.request import GenerationRequest
from tests.engine.fakes import FakePipeline, FakeStepPipeline, make_request
from tests.polling import until


def prioritized(request_id: str, priority: int) -> GenerationRequest:
    request = make_request(request_id, steps=1)
    return replace(request, params=replace(request.params, priority=priority))


async def run_in_order(pipeline: FakePipeline, batching: Batching) -> None:
    engine = AsyncEngine(ThreadExecutor(lambda: pipeline), EngineConfig(1, batching=batching))
    await engine.start()
    try:
        blocker = engine.submit(prioritized("blocker", 0))
        await until(lambda: engine.num_waiting == 0, "the blocker runs")
        low = engine.submit(prioritized("low", 10))  # queued first
        high = engine.submit(prioritized("high", -3))
        await until(lambda: engine.num_waiting == 2, "both wait behind the blocker")
        release(pipeline)
        for handle in (blocker, low, high):
            await handle.result()
    finally:
        release(pipeline)
        await engine.stop()


def release(pipeline: FakePipeline) -> None:
    if isinstance(pipeline, FakeStepPipeline):
        assert pipeline.permits is not None
        pipeline.permits.release(100)
    else:
        assert pipeline.gate is not None
        pipeline.gate.set()


async def test_request_mode_runs_the_better_priority_first() -> None:
    pipeline = FakePipeline()
    pipeline.gate = threading.Event()
    await run_in_order(pipeline, "request")
    assert pipeline.forwards == [["blocker"], ["high"], ["low"]]


async def test_step_mode_admits_the_better_priority_first() -> None:
    pipeline = FakeStepPipeline()
    pipeline.permits = threading.Semaphore(0)
    await run_in_order(pipeline, "step")
    assert pipeline.groups == [["blocker"], ["high"], ["low"]]
