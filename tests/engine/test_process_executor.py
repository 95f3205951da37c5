"""`ProcessExecutor` with a real worker process (spawned) over a picklable fake pipeline:
results through shared memory, byte for byte; no segment left behind on any path; a
killed worker fails its requests with 503 and comes back."""

from __future__ import annotations

import asyncio
import functools
import os
import signal
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import numpy as np
import pytest
import pytest_asyncio

from engine.config import Batching, EngineConfig
from engine.engine import AsyncEngine
from engine.errors import ForwardError, RequestAbortedError, WorkerCrashedError
from engine.process_executor import ProcessExecutor
from engine.request import GenerationRequest, SamplingParams
from engine.shm import segments
from tests.engine.process_fakes import GATE_ENV, SIDE, ArrayPipeline, image_for

pytestmark = pytest.mark.slow


@pytest.fixture
def gate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    path = tmp_path / "gate"
    monkeypatch.setenv(GATE_ENV, str(path))  # the worker is spawned with this environment
    yield path
    path.touch()  # never leave a worker held


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
