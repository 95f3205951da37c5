"""`--data-parallel-size`: one engine, several workers. Requests are shared out, batches (or
step groups) of two workers run at the same time, and a worker that dies costs only its
own requests (or none, with `retry_on_worker_crash`) while the others go on."""

from __future__ import annotations

import asyncio
import functools
import os
import signal
from pathlib import Path

import numpy as np
import pytest

from engine.core.config import Batching, EngineConfig
from engine.core.engine import AsyncEngine
from engine.core.lanes import Lane
from engine.core.stats import WorkSpan
from engine.errors import WorkerCrashedError
from engine.executor.process_executor import ProcessExecutor, WorkerStats
from engine.executor.thread_executor import ThreadExecutor
from engine.outputs import BatchOutput
from engine.sched.step_plan import StepPlan, work_ids
from engine.worker.stepping import Flag
from tests.engine.core.test_step_engine import hold, next_step_entered
from tests.engine.executor.test_process_executor import gate, make, no_leaks, wait_for_file
from tests.engine.fakes import FakeStepPipeline, make_request
from tests.engine.process_fakes import ArrayPipeline, image_for

__all__ = ["gate", "no_leaks"]  # fixtures


async def two_workers(batching: Batching, *, retry: bool = False) -> AsyncEngine:
    executors = [ProcessExecutor(functools.partial(ArrayPipeline)) for _ in range(2)]
    config = EngineConfig(max_num_seqs=8, batching=batching, retry_on_worker_crash=retry)
    engine = AsyncEngine(executors, config)
    await engine.start()
    return engine


async def both_entered(gate: Path) -> None:
    """Until two worker processes are inside a held forward (or step) at once."""
    for _ in range(1200):
        if len(list(gate.parent.glob(f"{gate.name}.entered-*"))) >= 2:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the two workers were never busy at the same time")


def worker(lane: Lane) -> WorkerStats:
    assert isinstance(lane.executor, ProcessExecutor)
    return lane.executor.stats


def kill(lane: Lane) -> None:
    pid = worker(lane).pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)


def overlap(a: WorkSpan, b: WorkSpan) -> bool:
    return a.started < b.ended and b.started < a.ended


@pytest.mark.slow
@pytest.mark.parametrize("batching", ["request", "step"])
async def test_two_workers_run_at_the_same_time(batching: Batching, gate: Path, no_leaks: None) -> None:
    engine = await two_workers(batching)
    try:
        first = engine.submit(make("HOLD one", 1))
        await wait_for_file(gate.with_suffix(".entered"))
        second = engine.submit(make("HOLD two", 2, width=64, height=64))  # another key, too
        await both_entered(gate)
        assert engine.workers_up == 2 and engine.num_running == 2
        gate.touch()
        outputs = await asyncio.gather(first.result(), second.result())
    finally:
        await engine.stop()
    for output, request in zip(outputs, (make("HOLD one", 1), make("HOLD two", 2)), strict=True):
        assert np.array_equal(output.images[0], image_for(request, output.seeds[0]))
    by_worker = {span.worker: span for span in engine.stats.spans}
    assert set(by_worker) == {0, 1} and overlap(by_worker[0], by_worker[1])
    assert all(lane.units >= 1 and lane.busy_s > 0 for lane in engine.lanes)


@pytest.mark.slow
@pytest.mark.parametrize("batching", ["request", "step"])
async def test_a_killed_worker_costs_only_its_own_requests(
    batching: Batching, gate: Path, no_leaks: None
) -> None:
    engine = await two_workers(batching)
    try:
        held = engine.submit(make("HOLD", 5))
        await wait_for_file(gate.with_suffix(".entered"))
        victim = next(lane for lane in engine.lanes if lane.running is not None)
        kill(victim)
        with pytest.raises(WorkerCrashedError, match="died"):
            await held.result()
        assert engine.workers_up == 1 and engine.unavailable is None  # the other one serves
        gate.touch()
        during = await asyncio.gather(*(engine.generate(make(f"meanwhile {i}", i)) for i in range(4)))
        assert len(during) == 4
        for _ in range(1200):  # the back-off, then a fresh worker
            if engine.workers_up == 2:
                break
            await asyncio.sleep(0.05)
        assert engine.workers_up == 2
        assert worker(victim).restarts == 1
        await asyncio.gather(*(engine.generate(make(f"after {i}", i)) for i in range(4)))
    finally:
        await engine.stop()


@pytest.mark.slow
@pytest.mark.parametrize("batching", ["request", "step"])
async def test_with_retry_a_request_whose_worker_died_runs_again_elsewhere(
    batching: Batching, gate: Path, no_leaks: None
) -> None:
    engine = await two_workers(batching, retry=True)
    try:
        held = engine.submit(make("HOLD", 7))
        await wait_for_file(gate.with_suffix(".entered"))
        victim = next(lane for lane in engine.lanes if lane.running is not None)
        kill(victim)
        gate.touch()  # the retry must not be held again
        output = await held.result()
    finally:
        await engine.stop()
    assert np.array_equal(output.images[0], image_for(make("HOLD", 7), 7))
    assert engine.stats.requests_failed == 0 and engine.stats.requests_finished == 1
    assert {span.worker for span in engine.stats.spans} == {0, 1}  # tried on one, served by the other


async def test_step_mode_keeps_a_key_on_its_worker_and_spreads_keys() -> None:
    """Submitted together (routing happens at admission): the first two go to the idle
    workers, each later one to the worker already stepping its shape."""
    pipelines = [FakeStepPipeline(), FakeStepPipeline()]
    executors = [ThreadExecutor(functools.partial(lambda p: p, p)) for p in pipelines]
    engine = AsyncEngine(executors, EngineConfig(max_num_seqs=8, batching="step"))
    await engine.start()
    try:
        handles = [
            engine.submit(make_request(rid, size=size, steps=2))
            for rid, size in (("a1", 64), ("b1", 128), ("a2", 64), ("b2", 128), ("a3", 64))
        ]
        await asyncio.gather(*(handle.result() for handle in handles))
    finally:
        await engine.stop()
    stepped = [{rid for group in p.groups for rid in group} for p in pipelines]
    assert stepped == [{"a1", "a2", "a3"}, {"b1", "b2"}]
    assert ["a1", "a2", "a3"] in pipelines[0].groups  # one forward for the key's requests


async def test_request_mode_shares_one_queue() -> None:
    """Any free worker takes the next batch: same-key requests form one batch wherever they
    came from, and nothing waits for one worker while another is free."""
    pipelines = [FakeStepPipeline(), FakeStepPipeline()]
    executors = [ThreadExecutor(functools.partial(lambda p: p, p)) for p in pipelines]
    engine = AsyncEngine(executors, EngineConfig(max_num_seqs=8, batching="request"))
    await engine.start()
    try:
        handles = [engine.submit(make_request(f"r{i}", steps=2)) for i in range(5)]
        await asyncio.gather(*(handle.result() for handle in handles))
    finally:
        await engine.stop()
    forwards = [f for p in pipelines for f in p.forwards]
    assert forwards == [["r0", "r1", "r2", "r3", "r4"]]


async def test_a_worker_that_cannot_start_stops_them_all() -> None:
    executors = [
        ProcessExecutor(functools.partial(ArrayPipeline)),
        ProcessExecutor(functools.partial(int, "not a pipeline")),
    ]
    engine = AsyncEngine(executors, EngineConfig())
    with pytest.raises(RuntimeError, match="could not load the pipeline"):
        await engine.start()
    assert all(not e.stats.alive for e in executors)


class DownableExecutor(ThreadExecutor):
    """A thread executor whose "worker" a test takes down: `health()` says why, a run in
    flight then fails its requests as crashed, and later runs wait for `back`, as a
    `ProcessExecutor` waits for its restarting worker."""

    def __init__(self, pipeline: FakeStepPipeline) -> None:
        super().__init__(functools.partial(lambda p: p, pipeline))
        self.down: str | None = None
        self.back = asyncio.Event()

    def health(self) -> str | None:
        return self.down

    async def execute_step(self, plan: StepPlan, attention: Flag | None = None) -> BatchOutput:
        if self.down is not None:
            await self.back.wait()
        output = await super().execute_step(plan, attention)
        if self.down is not None:  # it died during this run
            return BatchOutput(errors=dict.fromkeys(work_ids(plan), WorkerCrashedError(self.down)))
        return output


async def test_step_mode_requests_waiting_on_a_worker_that_goes_down_run_on_one_that_is_up() -> None:
    pipelines = [FakeStepPipeline(), FakeStepPipeline()]
    permits = [hold(p) for p in pipelines]
    down = DownableExecutor(pipelines[0])
    engine = AsyncEngine([down, ThreadExecutor(lambda: pipelines[1])], EngineConfig(8, batching="step"))
    await engine.start()
    try:
        lost = engine.submit(make_request("lost", steps=2))  # worker 0 (idle)
        await next_step_entered(pipelines[0])
        other = engine.submit(make_request("other", steps=2))  # worker 1 (idle)
        await next_step_entered(pipelines[1])
        waiting = engine.submit(make_request("waiting", steps=2))  # worker 0: both busy, a tie
        down.down = "the worker process died; restarting it"
        permits[0].release()  # the step in flight ends: "lost" failed with its worker
        with pytest.raises(WorkerCrashedError):
            await lost.result()
        permits[1].release(100)
        await asyncio.wait_for(asyncio.gather(other.result(), waiting.result()), 30)  # main: hang guard
    finally:
        down.back.set()
        permits[0].release(100)
        await engine.stop()
    assert any("waiting" in group for group in pipelines[1].groups)
