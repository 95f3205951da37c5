"""Step-level batching under pressure: Retry-After from the work ahead, running out of
memory (the learnt step budget, decodes in halves) and an executor that breaks. Fake
stepping pipelines in a real executor thread; steps held by permits, never timed."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from engine.core.config import EngineConfig
from engine.core.engine import AsyncEngine
from engine.errors import ForwardError, QueueFullError
from engine.executor.thread_executor import ThreadExecutor
from engine.outputs import BatchOutput, ForwardRecord
from engine.request import GenerationRequest, RequestOutput
from engine.sched.step_plan import StepPlan
from engine.sched.step_scheduler import StepScheduler
from engine.worker.stepping import StepRunner
from tests.engine.core.test_step_engine import hold, next_step_entered, started
from tests.engine.fakes import FakeMemoryStepPipeline, FakeStepPipeline, make_request
from tests.polling import until


async def retry_after_behind_forty_steps(engine: AsyncEngine, pipeline: FakeStepPipeline) -> float:
    """The Retry-After of a request refused by a full queue while 40 steps are ahead (10
    running, 10 and 20 waiting) and a step measured 3 s carrying 2 requests."""
    permits = hold(pipeline)
    await engine.start()
    try:
        running = asyncio.create_task(engine.generate(make_request("a", steps=10)))
        await next_step_entered(pipeline)  # no step has ended: nothing timed but this
        engine.stats.record_forwards([ForwardRecord(num_requests=2, num_images=2, seconds=3.0, ok=True)])
        queued = (make_request("b", steps=10), make_request("c", steps=20))
        waiting = [asyncio.create_task(engine.generate(request)) for request in queued]
        await until(lambda: engine.num_waiting == 2, "b and c wait")
        with pytest.raises(QueueFullError) as full:
            engine.submit(make_request("d", steps=4))
        permits.release(1000)
        await asyncio.gather(running, *waiting)
    finally:
        permits.release(1000)
        await engine.stop()
    return full.value.retry_after_s


async def test_a_full_queue_says_retry_after_the_steps_ahead_at_the_measured_step_time() -> None:
    """Not the floor of 1 s that one step's time times the batches ahead gave."""
    pipeline = FakeStepPipeline()
    engine = AsyncEngine(ThreadExecutor(lambda: pipeline), EngineConfig(1, batching="step", max_queue_len=2))
    assert await retry_after_behind_forty_steps(engine, pipeline) == pytest.approx(40 * 3.0 / 2)


async def test_retry_after_counts_only_the_workers_that_are_up() -> None:
    """Two lanes, one whose worker is down (restarting): the work ahead is done by one
    worker, so 40 steps at 3 s, 2 requests per step, is 60 s, not 30."""
    pipeline = FakeStepPipeline()
    down = ThreadExecutor(FakeStepPipeline)
    down.health = lambda: "the worker is restarting"  # type: ignore[method-assign]
    config = EngineConfig(1, batching="step", max_queue_len=2)
    engine = AsyncEngine([ThreadExecutor(lambda: pipeline), down], config)
    assert await retry_after_behind_forty_steps(engine, pipeline) == pytest.approx(40 * 3.0 / 2)
    assert engine.workers_up == 1


async def test_a_step_out_of_memory_serves_everyone_and_lowers_the_budget() -> None:
    """Steps of more than 3 images run out of memory: the group is retried in halves, the
    lane's budget is lowered to what fitted (shown in /metrics), and later groups keep to it."""
    from server.metrics import Metrics

    pipeline = FakeMemoryStepPipeline(fits=3)
    engine = await started(pipeline, max_num_seqs=8)
    metrics = Metrics()
    metrics.bind(engine)
    try:
        outputs = await asyncio.gather(*(engine.generate(make_request(f"r{i}", steps=3)) for i in range(8)))
        scheduler = engine.scheduler
        assert isinstance(scheduler, StepScheduler)
        budget = scheduler.max_step_cost
        gauge = metrics.registry.get_sample_value("diffbatch_step_token_budget", {"worker": "0"})
    finally:
        await engine.stop()
    assert [o.request_id for o in outputs] == [f"r{i}" for i in range(8)]
    # 64 step tokens per request: what fitted, at most 3 requests.
    assert budget is not None and 64 <= budget <= 3 * 64 and gauge == budget
    failed = [i for i, images in enumerate(pipeline.attempts) if images > 3]
    assert failed and len(failed) <= 3  # learnt in the first run that ran out
    assert max(pipeline.attempts[failed[-1] + 1 :]) <= budget // 64


class _HalvingDecodesStepPipeline(FakeStepPipeline):
    """Its prepare runs out of memory for more than one request; its VAE (as
    `pipelines.decode.HalvingDecode` would) halves every decode of more than one image,
    counting each in `decode_out_of_memory()`."""

    def __init__(self) -> None:
        super().__init__()
        self.decodes_halved = 0

    def decode_out_of_memory(self) -> int:
        return self.decodes_halved

    def prepare(self, requests: list[GenerationRequest]) -> list[Any]:
        if len(requests) > 1:
            raise MemoryError("out of memory (fake)")
        return super().prepare(requests)

    def finish(self, states: list[Any]) -> list[RequestOutput]:
        if sum(state.num_images for state in states) > 1:
            self.decodes_halved += 1
        return super().finish(states)


async def test_out_of_memory_handled_in_halves_is_counted_in_metrics_and_leaves_the_budget() -> None:
    """Each kind of out-of-memory error is counted where /metrics shows it: a prepare retried
    in halves, decodes halved in the VAE; neither lowers the step budget (only steps do)."""
    from server.metrics import Metrics

    pipeline = _HalvingDecodesStepPipeline()
    engine = await started(pipeline, max_num_seqs=4)
    metrics = Metrics()
    metrics.bind(engine)
    try:
        await asyncio.gather(*(engine.generate(make_request(f"r{i}", steps=1, n=2)) for i in range(2)))
        scheduler = engine.scheduler
        assert isinstance(scheduler, StepScheduler) and scheduler.max_step_cost == scheduler.budget.configured
        sample = metrics.registry.get_sample_value
        prepare = sample("diffbatch_stage_out_of_memory_total", {"stage": "prepare"})
        decode = sample("diffbatch_stage_out_of_memory_total", {"stage": "decode"})
    finally:
        await engine.stop()
    assert prepare == 1 and decode == pipeline.decodes_halved and decode >= 1


def test_a_decode_beside_the_steps_that_runs_out_of_memory_reports_what_fitted() -> None:
    pipeline = FakeStepPipeline()
    finish = pipeline.finish

    def decode_one_at_a_time(states: list[Any]) -> list[RequestOutput]:
        if len(states) > 1:
            raise MemoryError("out of memory (fake)")
        return finish(states)

    pipeline.finish = decode_one_at_a_time  # type: ignore[method-assign]
    runner = StepRunner(pipeline, decode_overlap="on")
    plan = StepPlan(join=(make_request("a", steps=1), make_request("b", steps=1)), step=("a", "b"))
    try:
        result = runner.run(plan, threading.Event())
    finally:
        runner.close()
    assert runner.decodes_beside == 1 and sorted(result.outputs) == ["a", "b"]
    finishes = [(fit.cost, fit.out_of_memory) for fit in result.fits if fit.stage == "finish"]
    assert finishes == [(128, True), (64, False), (64, False)]


class ScriptedStepExecutor(ThreadExecutor):
    """Answers step plans from `script` instead of stepping: each entry an output, or an
    exception to raise (the executor broke); nothing once it is used up."""

    def __init__(self, script: list[BatchOutput | Exception]) -> None:
        super().__init__(FakeStepPipeline)
        self.script = script

    async def execute_step(self, plan: StepPlan, attention: Any = None) -> BatchOutput:
        await asyncio.sleep(0)
        what = self.script.pop(0) if self.script else BatchOutput()
        if isinstance(what, Exception):
            raise what
        return what


async def test_an_executor_that_breaks_fails_the_requests_decoding_beside_the_steps_too() -> None:
    executor = ScriptedStepExecutor([BatchOutput(decoding=["x"]), RuntimeError("broke")])
    engine = AsyncEngine(executor, EngineConfig(8, batching="step"))
    await engine.start()
    try:
        x, y = (engine.submit(make_request(rid, steps=3)) for rid in ("x", "y"))
        with pytest.raises(ForwardError, match="broke"):
            await asyncio.wait_for(y.result(), 30)
        with pytest.raises(ForwardError, match="broke"):
            await asyncio.wait_for(x.result(), 30)  # main: never ends (hang guard)
        steps = engine.lanes[0].steps
        assert steps is not None and not steps.has_work()
    finally:
        await engine.stop()
