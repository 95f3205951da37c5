"""Preemption through the engine in step mode, with fake pipelines: in a real executor thread
(steps held by permits) and in a worker process (held by a gate file). A running request of
worse priority pauses for a better one, keeps its state where the executor holds it, and
resumes from the same step; an abort while paused drops that state."""

from __future__ import annotations

import functools
import threading
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from engine.core.config import EngineConfig
from engine.core.engine import AsyncEngine
from engine.errors import RequestAbortedError
from engine.executor.process_executor import ProcessExecutor
from engine.executor.thread_executor import ThreadExecutor
from engine.executor.worker_loop import Done, RunStep
from engine.outputs import BatchOutput
from engine.request import GenerationRequest, RequestOutput
from engine.sched.step_plan import StepPlan
from engine.sched.step_scheduler import StepScheduler
from server.metrics import Metrics
from tests.engine.fakes import FakeStepPipeline, make_request
from tests.engine.process_fakes import GATE_ENV, ArrayPipeline, FakeWorker, image_for
from tests.polling import until


def prioritized(request_id: str, priority: int, steps: int, prompt: str = "a cat") -> GenerationRequest:
    request = make_request(request_id, steps=steps, prompt=prompt)
    return replace(request, params=replace(request.params, priority=priority))


def steps_of(engine: AsyncEngine) -> StepScheduler:
    scheduler = engine.scheduler
    assert isinstance(scheduler, StepScheduler)
    return scheduler


async def started(pipeline: FakeStepPipeline, preemption: bool = True) -> tuple[AsyncEngine, Metrics]:
    pipeline.permits = threading.Semaphore(0)
    config = EngineConfig(1, batching="step", preemption=preemption)
    engine = AsyncEngine(ThreadExecutor(lambda: pipeline), config)
    await engine.start()
    metrics = Metrics()
    metrics.bind(engine)
    return engine, metrics


async def take_steps(pipeline: FakeStepPipeline, count: int) -> None:
    assert pipeline.permits is not None
    goal = len(pipeline.groups) + count
    pipeline.permits.release(count)
    await until(lambda: len(pipeline.groups) >= goal, f"{count} more steps")


async def test_a_better_request_pauses_a_running_one_which_resumes_where_it_was() -> None:
    pipeline = FakeStepPipeline()
    engine, metrics = await started(pipeline)
    sample = metrics.registry.get_sample_value
    try:
        low = engine.submit(prioritized("low", 10, steps=6))
        await take_steps(pipeline, 2)  # its third step waits for a permit
        high = engine.submit(prioritized("high", 0, steps=3))
        await take_steps(pipeline, 1)  # low's third step; then it pauses for high
        await until(lambda: steps_of(engine).num_paused == 1, "low pauses")
        assert sample("diffbatch_num_requests_paused") == 1.0
        assert sample("diffbatch_num_requests_running") == 1.0  # high; low is not running
        assert sample("diffbatch_preemptions_total") == 1.0
        assert pipeline.permits is not None
        pipeline.permits.release(100)
        high_output, low_output = await high.result(), await low.result()
    finally:
        await engine.stop()
    assert pipeline.groups == [["low"]] * 3 + [["high"]] * 3 + [["low"]] * 3
    assert pipeline.prepared == ["low", "high"]  # low resumed: it was not prepared again
    assert low_output.images == (("a cat", 0),) and high_output.images == (("a cat", 0),)
    assert sample("diffbatch_num_requests_paused") == 0.0
    assert sample("diffbatch_preemptions_total") == 1.0


async def test_aborting_a_paused_request_drops_its_state() -> None:
    pipeline = FakeStepPipeline()
    engine, _ = await started(pipeline)
    try:
        low = engine.submit(prioritized("low", 10, steps=6))
        await take_steps(pipeline, 1)
        high = engine.submit(prioritized("high", 0, steps=3))
        await take_steps(pipeline, 1)
        await until(lambda: steps_of(engine).num_paused == 1, "low pauses")
        low.abort()
        with pytest.raises(RequestAbortedError):
            await low.result()
        assert pipeline.permits is not None
        pipeline.permits.release(100)
        await high.result()
        runner = engine.executor.step_runner  # type: ignore[attr-defined]
        await until(lambda: not runner.states, "the paused state is dropped")
    finally:
        await engine.stop()
    assert pipeline.groups == [["low"]] * 2 + [["high"]] * 3
    assert steps_of(engine).num_paused == 0 and not steps_of(engine).has_work()


async def test_with_preemption_off_the_running_request_runs_on() -> None:
    pipeline = FakeStepPipeline()
    engine, metrics = await started(pipeline, preemption=False)
    try:
        low = engine.submit(prioritized("low", 10, steps=3))
        await take_steps(pipeline, 1)
        high = engine.submit(prioritized("high", 0, steps=2))
        assert pipeline.permits is not None
        pipeline.permits.release(100)
        await low.result()
        await high.result()
    finally:
        await engine.stop()
    assert pipeline.groups == [["low"]] * 3 + [["high"]] * 2
    assert metrics.registry.get_sample_value("diffbatch_preemptions_total") == 0.0


@pytest.mark.slow
async def test_in_a_worker_process_the_paused_state_stays_in_the_worker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = tmp_path / "gate"
    monkeypatch.setenv(GATE_ENV, str(gate))  # the worker is spawned with this environment
    executor = ProcessExecutor(functools.partial(ArrayPipeline))
    engine = AsyncEngine(executor, EngineConfig(1, batching="step"))
    await engine.start()
    try:
        low_request = prioritized("low", 10, steps=4, prompt="HOLD low")
        low = engine.submit(low_request)
        await until(lambda: gate.with_suffix(".entered").exists(), "low's first step is held")
        high_request = prioritized("high", 0, steps=2)
        high = engine.submit(high_request)  # sets the attention flag: low pauses after this step
        gate.touch()
        high_output = await high.result()
        assert steps_of(engine).preemptions == 1
        low_output = await low.result()
        # It resumed in the worker, from its own state (a step of a state the worker did not
        # hold would be skipped, and low would never finish); nothing is held there now.
        assert not executor._held._holding
    finally:
        gate.touch()
        await engine.stop()
    for request, output in ((low_request, low_output), (high_request, high_output)):
        assert np.array_equal(output.images[0], image_for(request, output.seeds[0]))


async def test_the_process_executor_keeps_a_paused_state_held_and_sends_its_drop() -> None:
    """With a stand-in worker: a paused request stays held (its state is in the worker: lost
    if the worker dies, so it fails then), and aborting it sends its drop with the next plan."""
    executor = ProcessExecutor(functools.partial(ArrayPipeline))  # never started
    ending: set[str] = set()  # the stand-in finishes these when they step

    def answer(run: RunStep) -> Done:
        ended = {rid: RequestOutput(rid, (), ()) for rid in run.plan.step if rid in ending}
        return Done(run.call_id, BatchOutput(outputs=ended))

    worker = FakeWorker(executor, answer)
    scheduler = StepScheduler(max_num_seqs=1)

    async def run_plan() -> StepPlan:
        plan = scheduler.schedule()
        assert plan is not None
        output = await executor.execute_step(plan)
        scheduler.finish(list(output.outputs))
        sent: RunStep = worker.sent[-1]
        return sent.plan

    scheduler.add(prioritized("low", 10, steps=6), ("a",))
    await run_plan()
    scheduler.add(prioritized("high", 0, steps=3), ("a",))
    sent = await run_plan()
    assert sent.step == ("high",) and sent.drop == ()
    assert executor._held._holding == {"low", "high"}
    scheduler.abort("low")
    ending.add("high")
    sent = await run_plan()
    assert sent.drop == ("low",) and executor._held._holding == set()
    scheduler.add(prioritized("low-2", 10, steps=6), ("a",))
    await run_plan()
    scheduler.add(prioritized("high-2", 0, steps=3), ("a",))
    await run_plan()
    assert scheduler.is_paused("low-2")
    lost = executor._held.died()
    assert lost == {"low-2", "high-2"}
    assert sorted(scheduler.finish(sorted(lost))) == ["high-2", "low-2"]  # both fail, owed an error
