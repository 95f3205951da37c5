"""`ProcessExecutor` with a real worker process (spawned) over a picklable fake pipeline:
results through shared memory, byte for byte; no segment left behind on any path; a
killed worker fails its requests with 503 and comes back; two executors never touch each
other's segments; a result the server cannot read fails its call, not the lane; a worker
that loads too long is stopped, and shutdown stops one that is still loading."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import multiprocessing
import os
import signal
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import numpy as np
import pytest
import pytest_asyncio

from engine.core.config import Batching, EngineConfig
from engine.core.engine import AsyncEngine
from engine.errors import ForwardError, RequestAbortedError, WorkerCrashedError, WorkerMessageError
from engine.executor.process_executor import ProcessExecutor
from engine.executor.shm import segments, worker_prefix
from engine.executor.worker_loop import Done, Failed, RunStep, WorkerOptions, serve
from engine.executor.worker_process import InputsNotSharedError
from engine.outputs import BatchOutput
from engine.request import GenerationRequest, RequestBatch, SamplingParams
from engine.sched.step_plan import StepPlan
from tests.engine.process_fakes import (
    GATE_ENV,
    SIDE,
    ArrayPipeline,
    FakeWorker,
    image_for,
    slow_loading_pipeline,
    unsendable_spec_pipeline,
)
from tests.polling import until

pytestmark = pytest.mark.slow


@pytest.fixture
def gate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    path = tmp_path / "gate"
    monkeypatch.setenv(GATE_ENV, str(path))  # the worker is spawned with this environment
    yield path
    path.touch()  # never leave a worker held
    path.with_suffix(".hold-load").unlink(missing_ok=True)


@pytest.fixture
def no_leaks() -> Iterator[None]:
    before = set(segments("diffbatch-"))
    yield
    assert set(segments("diffbatch-")) <= before  # none new (orphans of dead processes may be swept)


async def started(batching: Batching) -> tuple[AsyncEngine, ProcessExecutor]:
    executor = ProcessExecutor(functools.partial(ArrayPipeline))
    engine = AsyncEngine(executor, EngineConfig(max_num_seqs=8, batching=batching))
    await engine.start()
    return engine, executor


@pytest_asyncio.fixture(params=["request", "step"])
async def running(
    request: pytest.FixtureRequest, gate: Path
) -> AsyncIterator[tuple[AsyncEngine, ProcessExecutor]]:
    engine, executor = await started(request.param)
    yield engine, executor
    gate.touch()
    await engine.stop()


def make(prompt: str, seed: int, n: int = 1, **fields: object) -> GenerationRequest:
    params = SamplingParams(num_inference_steps=3, seed=seed, n=n, **fields)  # type: ignore[arg-type]
    return GenerationRequest.create(prompt, params)


async def test_images_come_back_through_shared_memory_byte_for_byte(
    running: tuple[AsyncEngine, ProcessExecutor], no_leaks: None
) -> None:
    engine, executor = running
    requests = [make(f"p{i}", seed=10 * i, n=2) for i in range(3)]
    outputs = await asyncio.gather(*(engine.generate(r) for r in requests))
    for request, output in zip(requests, outputs, strict=True):
        assert len(output.images) == 2
        for image, seed in zip(output.images, output.seeds, strict=True):
            assert image.shape == (SIDE, SIDE, 3)
            assert np.array_equal(image, image_for(request, seed))
    assert executor.stats.segments_received == 6  # one segment per image, none pickled


async def test_input_images_go_to_the_worker_through_shared_memory(
    running: tuple[AsyncEngine, ProcessExecutor], no_leaks: None
) -> None:
    engine, _ = running
    picture = np.random.default_rng(7).integers(0, 256, (200, 300, 3), dtype=np.uint8)
    request = GenerationRequest.create("edit", SamplingParams(num_inference_steps=2), input_images=(picture,))
    output = await engine.generate(request)
    assert np.array_equal(output.images[0], picture)  # the fake echoes its input


async def test_a_failing_request_fails_alone_and_leaves_no_segment(
    running: tuple[AsyncEngine, ProcessExecutor], no_leaks: None
) -> None:
    engine, _ = running
    results = await asyncio.gather(
        engine.generate(make("fine", 1)), engine.generate(make("FAIL", 2)), return_exceptions=True
    )
    assert isinstance(results[0].images[0], np.ndarray)  # type: ignore[union-attr]
    assert isinstance(results[1], ForwardError)


async def test_an_aborted_requests_images_are_freed(
    running: tuple[AsyncEngine, ProcessExecutor], gate: Path, no_leaks: None
) -> None:
    engine, _ = running
    handle = engine.submit(make("HOLD", 3, n=2))
    await wait_for_file(gate.with_suffix(".entered"))
    handle.abort()
    with pytest.raises(RequestAbortedError):
        await handle.result()
    gate.touch()  # the worker finishes and sends images nobody wants: they are unlinked
    await engine.generate(make("after", 4))  # runs after the abandoned work came back


async def test_a_killed_worker_fails_its_requests_with_503_and_comes_back(
    running: tuple[AsyncEngine, ProcessExecutor], gate: Path, no_leaks: None
) -> None:
    engine, executor = running
    held = engine.submit(make("HOLD", 5))
    await wait_for_file(gate.with_suffix(".entered"))
    assert executor.stats.pid is not None
    os.kill(executor.stats.pid, signal.SIGKILL)
    with pytest.raises(WorkerCrashedError, match="died"):
        await held.result()
    assert engine.unavailable is not None and "restarting" in engine.unavailable
    for _ in range(1200):  # the back-off, then a fresh worker
        if engine.unavailable is None:
            break
        await asyncio.sleep(0.05)
    assert executor.stats.restarts == 1 and executor.stats.crashes == 1
    gate.touch()
    output = await engine.generate(make("after", 6))
    assert np.array_equal(output.images[0], image_for(make("after", 6), 6))


async def test_a_worker_that_cannot_load_stops_the_start_with_its_reason() -> None:
    executor = ProcessExecutor(functools.partial(int, "not a pipeline"))
    engine = AsyncEngine(executor, EngineConfig())
    with pytest.raises(RuntimeError, match="could not load the pipeline: ValueError"):
        await engine.start()


async def test_a_worker_whose_ready_cannot_be_pickled_stops_the_start_with_its_reason() -> None:
    # Before: the worker logged the lost message and the start waited out its timeout.
    executor = ProcessExecutor(unsendable_spec_pipeline, start_timeout_s=60)
    engine = AsyncEngine(executor, EngineConfig())
    with pytest.raises(
        RuntimeError, match=r"could not load the pipeline: the worker cannot send its Ready.*lock"
    ):
        await engine.start()


async def wait_for_file(path: Path) -> None:
    for _ in range(1200):
        if path.exists():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{path} never appeared")


async def test_step_mode_previews_travel_too(gate: Path, no_leaks: None) -> None:
    engine, executor = await started("step")
    try:
        handle = engine.submit(make("preview", 8, partial_images=2))
        events = [event async for event in handle.events()]
    finally:
        await engine.stop()
    partials, final = events[:-1], events[-1]
    assert [p.index for p in partials] == [0, 1]  # type: ignore[union-attr]
    assert all(p.images[0].shape == (SIDE, SIDE, 3) for p in partials)  # type: ignore[union-attr]
    assert np.array_equal(final.images[0], image_for(make("preview", 8), 8))  # type: ignore[union-attr]
    assert executor.stats.segments_received == 3


def picture(seed: int) -> np.ndarray:
    """An input image large enough to go to the worker through shared memory."""
    return np.random.default_rng(seed).integers(0, 256, (200, 300, 3), dtype=np.uint8)


def edit(seed: int) -> RequestBatch:
    params = SamplingParams(num_inference_steps=2, seed=seed)
    request = GenerationRequest.create("edit", params, input_images=(picture(seed),))
    return RequestBatch((), (request,))


def inputs_in_flight() -> list[str]:
    """This process's shared-memory segments of input images not yet read by a worker."""
    return segments(f"{worker_prefix()}in-")


async def test_two_executors_inputs_neither_collide_nor_are_swept_by_the_other(no_leaks: None) -> None:
    """Two lanes of one server: each names its input segments apart, and a dead worker's
    sweep removes only what its own lane sent it."""
    a, b = (ProcessExecutor(functools.partial(ArrayPipeline)) for _ in range(2))
    await asyncio.gather(a.start(), b.start())
    assert a.stats.pid is not None and b.stats.pid is not None
    try:
        # a's worker reads nothing while stopped: the input sent to it waits in shared memory.
        os.kill(a.stats.pid, signal.SIGSTOP)
        waiting_in_a = asyncio.create_task(a.execute_batch(edit(1)))
        await until(lambda: len(inputs_in_flight()) == 1, "a's input waits in shared memory")
        batch = edit(2)
        output = await asyncio.wait_for(b.execute_batch(batch), 60)
        assert not output.errors, output.errors  # main: FileExistsError, taken for a crash (503)
        assert np.array_equal(output.outputs[batch.request_ids[0]].images[0], picture(2))
        # Now b's input waits too, and a's worker dies: its sweep leaves b's input alone.
        os.kill(b.stats.pid, signal.SIGSTOP)
        batch = edit(3)
        waiting_in_b = asyncio.create_task(b.execute_batch(batch))
        await until(lambda: len(inputs_in_flight()) == 2, "b's input waits in shared memory")
        os.kill(a.stats.pid, signal.SIGKILL)
        lost = await asyncio.wait_for(waiting_in_a, 60)
        assert isinstance(next(iter(lost.errors.values())), WorkerCrashedError)
        os.kill(b.stats.pid, signal.SIGCONT)
        output = await asyncio.wait_for(waiting_in_b, 60)
        assert not output.errors, output.errors  # main: its input was swept; b's worker died
        assert np.array_equal(output.outputs[batch.request_ids[0]].images[0], picture(3))
    finally:
        for executor in (a, b):
            if executor.stats.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(executor.stats.pid, signal.SIGCONT)
        await asyncio.gather(a.shutdown(), b.shutdown())
    assert b.stats.crashes == 0


async def test_an_unreadable_result_fails_its_requests_with_500_and_the_lane_goes_on(
    running: tuple[AsyncEngine, ProcessExecutor], no_leaks: None
) -> None:
    engine, executor = running
    # Two images through shared memory in the message that cannot be read: both unlinked.
    with pytest.raises(WorkerMessageError, match="could not be read") as raised:
        await asyncio.wait_for(engine.generate(make("UNREADABLE", 1, n=2)), 60)  # main: hangs
    assert isinstance(raised.value, ForwardError)  # a 500, not a 503: the worker is fine
    output = await asyncio.wait_for(engine.generate(make("after", 2)), 60)
    assert np.array_equal(output.images[0], image_for(make("after", 2), 2))
    assert executor.stats.alive and executor.stats.crashes == 0


@pytest.mark.parametrize("batching", ["request", "step"])
async def test_an_unreadable_result_runs_once_more_with_retry_on_worker_crash(
    batching: Batching, gate: Path, no_leaks: None
) -> None:
    executor = ProcessExecutor(functools.partial(ArrayPipeline))
    engine = AsyncEngine(executor, EngineConfig(batching=batching, retry_on_worker_crash=True))
    await engine.start()
    try:
        request = make("UNREADABLE ONCE", 3)
        output = await asyncio.wait_for(engine.generate(request), 60)
    finally:
        await engine.stop()
    assert np.array_equal(output.images[0], image_for(request, 3))


async def test_a_worker_that_loads_too_long_is_stopped_and_the_log_says_what_it_loads(
    gate: Path, caplog: pytest.LogCaptureFixture
) -> None:
    gate.with_suffix(".hold-load").touch()
    before = set(multiprocessing.active_children())
    executor = ProcessExecutor(slow_loading_pipeline, start_timeout_s=1.0, loading="the array model")
    with (
        caplog.at_level(logging.INFO, logger="engine.executor.process_executor"),
        pytest.raises(RuntimeError, match=r"did not load the array model within 1 s.*--worker-start-timeout"),
    ):
        await executor.start()
    assert "loading the array model" in caplog.text
    # Killed and reaped, whether it was still starting (a busy machine may take over the
    # second to import torch) or already loading.
    assert set(multiprocessing.active_children()) <= before
    for loading in gate.parent.glob(f"{gate.name}.loading-*"):
        assert not Path(f"/proc/{loading.suffix.rsplit('-', 1)[1]}").exists()


async def test_shutdown_stops_a_worker_that_is_still_loading(gate: Path, no_leaks: None) -> None:
    executor = ProcessExecutor(slow_loading_pipeline)
    await executor.start()
    assert executor.stats.pid is not None
    gate.with_suffix(".hold-load").touch()
    os.kill(executor.stats.pid, signal.SIGKILL)
    await until(lambda: any(gate.parent.glob(f"{gate.name}.loading-*")), "the new worker is loading")
    (loading,) = gate.parent.glob(f"{gate.name}.loading-*")
    await asyncio.wait_for(executor.shutdown(), 60)
    assert not Path(f"/proc/{loading.suffix.rsplit('-', 1)[1]}").exists()  # main: it loads on


def test_a_worker_whose_server_is_gone_exits_quietly() -> None:
    """It reports ready to nobody: no BrokenPipeError traceback, exit code 0."""
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    process = context.Process(target=serve, args=(ArrayPipeline, WorkerOptions(), child, []))
    process.start()
    child.close()
    parent.close()  # the server is gone before the worker is ready
    process.join(timeout=60)
    assert process.exitcode == 0  # main: 1, after a BrokenPipeError traceback


def named(request_id: str) -> GenerationRequest:
    return GenerationRequest.create("p", SamplingParams(), request_id=request_id)


def step_executor() -> ProcessExecutor:
    return ProcessExecutor(functools.partial(ArrayPipeline))  # never started: a FakeWorker serves


async def test_a_joiners_input_that_cannot_be_shared_fails_only_the_joiner() -> None:
    """/dev/shm is full when a joiner's input image is sent: the plan never reached the
    worker, so only the joiner fails; the running group steps on, and the drops that plan
    carried go with the next one."""
    executor = step_executor()

    def answer(run: RunStep) -> Done:
        if any(r.input_images for r in run.plan.join):
            raise InputsNotSharedError("no space left on device")
        return Done(run.call_id, BatchOutput())

    worker = FakeWorker(executor, answer)
    await executor.execute_step(StepPlan(join=(named("a"), named("b")), step=()))
    joiner = GenerationRequest.create("edit", SamplingParams(), input_images=(picture(1),), request_id="c")
    output = await executor.execute_step(StepPlan(join=(joiner,), step=("a", "b"), drop=("gone",)))
    assert set(output.errors) == {"c"}  # main: a and b failed too
    assert isinstance(output.errors["c"], ForwardError)
    await executor.execute_step(StepPlan(join=(), step=("a", "b")))
    assert worker.sent[-1].plan.drop == ("gone",)  # the worker still has to drop it
    assert executor._held.died() == {"a", "b"}  # the joiner is not held; a and b still are


async def test_a_run_the_worker_reports_failed_fails_its_requests_and_those_decoding_beside() -> None:
    executor = step_executor()
    answers = iter([BatchOutput(decoding=["a"])])

    def answer(run: RunStep) -> Done | Failed:
        output = next(answers, None)
        return Done(run.call_id, output) if output is not None else Failed(run.call_id, RuntimeError("broke"))

    FakeWorker(executor, answer)
    await executor.execute_step(StepPlan(join=(named("a"), named("b")), step=()))
    output = await executor.execute_step(StepPlan(join=(), step=("b",)))  # main: raises RuntimeError
    assert set(output.errors) == {"a", "b"}
    assert all(isinstance(error, ForwardError) for error in output.errors.values())
    assert "broke" not in str(output.errors["b"])  # the worker's exception stays in the log
