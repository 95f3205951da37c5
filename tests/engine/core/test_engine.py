"""The engine loop with a fake pipeline in a real executor thread."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from dataclasses import replace

import numpy as np
import pytest
import pytest_asyncio

from engine.core.config import EngineConfig
from engine.core.engine import AsyncEngine
from engine.errors import (
    DeadlineExceededError,
    DuplicateRequestError,
    EngineNotRunningError,
    ForwardError,
    InvalidRequestError,
    QueueFullError,
    RequestAbortedError,
)
from engine.executor.thread_executor import ThreadExecutor
from engine.outputs import DecodeRecord, ForwardRecord, ModerationRecord
from engine.request import GenerationRequest, RequestBatch, RequestOutput, SamplingParams
from engine.timeline import RequestTimeline
from tests.engine.fakes import (
    FakeDenoisingPipeline,
    FakeInputPipeline,
    FakeMemoryPipeline,
    FakePipeline,
    FakeSerialPipeline,
    make_request,
)
from tests.polling import HANG_GUARD_S, until


async def started(pipeline: FakePipeline, **config: object) -> AsyncEngine:
    engine = AsyncEngine(ThreadExecutor(lambda: pipeline), EngineConfig(**config))  # type: ignore[arg-type]
    await engine.start()
    return engine


@pytest_asyncio.fixture
async def pipeline() -> AsyncIterator[FakePipeline]:
    fake = FakePipeline()
    yield fake
    if fake.gate is not None:
        fake.gate.set()


async def wait_until_forward_started(pipeline: FakePipeline) -> None:
    await asyncio.to_thread(pipeline.started.wait, 5)


async def test_concurrent_compatible_requests_run_as_one_forward(pipeline: FakePipeline) -> None:
    pipeline.gate = threading.Event()
    engine = await started(pipeline, max_num_seqs=8)
    try:
        # Hold the first forward so the next eight arrive while it runs and batch together.
        first = asyncio.create_task(engine.generate(make_request("warm")))
        await wait_until_forward_started(pipeline)
        tasks = [
            asyncio.create_task(engine.generate(make_request(f"r{i}", prompt=f"p{i}"))) for i in range(8)
        ]
        await until(lambda: engine.num_waiting == 8, "all eight wait behind the held forward")
        pipeline.gate.set()
        outputs = await asyncio.gather(*tasks)
        await first
    finally:
        await engine.stop()
    assert pipeline.forwards[1] == [f"r{i}" for i in range(8)]
    assert [o.images[0][0] for o in outputs] == [f"p{i}" for i in range(8)]
    assert engine.stats.forward_sizes[8] == 1


async def test_admission_wait_gathers_a_burst_into_one_forward(pipeline: FakePipeline) -> None:
    # An hour's wait: only a full batch can end it before the hang guard (no clock is read).
    engine = await started(pipeline, max_num_seqs=4, request_batch_max_wait_ms=3_600_000)
    try:
        async with asyncio.timeout(HANG_GUARD_S):
            outputs = await asyncio.gather(*(engine.generate(make_request(f"r{i}")) for i in range(4)))
    finally:
        await engine.stop()
    assert len(outputs) == 4
    assert pipeline.forwards == [["r0", "r1", "r2", "r3"]]


async def test_without_admission_wait_an_idle_engine_runs_at_once(pipeline: FakePipeline) -> None:
    engine = await started(pipeline, max_num_seqs=8)
    try:
        await engine.generate(make_request("a"))
    finally:
        await engine.stop()
    assert pipeline.forwards == [["a"]]


async def test_non_batch_pipeline_gets_one_forward_per_request() -> None:
    serial = FakeSerialPipeline()
    engine = await started(serial, max_num_seqs=8, request_batch_max_wait_ms=500)
    try:
        await asyncio.gather(*(engine.generate(make_request(f"r{i}")) for i in range(4)))
    finally:
        await engine.stop()
    assert serial.forwards == [["r0"], ["r1"], ["r2"], ["r3"]]


async def test_one_failing_request_does_not_fail_its_peers(pipeline: FakePipeline) -> None:
    pipeline.gate = threading.Event()
    engine = await started(pipeline, max_num_seqs=8)
    try:
        first = asyncio.create_task(engine.generate(make_request("warm")))
        await wait_until_forward_started(pipeline)
        prompts = [f"p{i}" for i in range(8)]
        prompts[3] = "please FAIL"
        tasks = [
            asyncio.create_task(engine.generate(make_request(f"r{i}", prompt=p)))
            for i, p in enumerate(prompts)
        ]
        await until(lambda: engine.num_waiting == 8, "all eight wait behind the held forward")
        pipeline.gate.set()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        await first
    finally:
        await engine.stop()
    assert isinstance(results[3], ForwardError)
    assert "marked request failed" in str(results[3])
    assert all(not isinstance(r, BaseException) for i, r in enumerate(results) if i != 3)
    assert engine.stats.requests_failed == 1


async def test_cancelled_waiting_request_never_runs(pipeline: FakePipeline) -> None:
    pipeline.gate = threading.Event()
    engine = await started(pipeline, max_num_seqs=8)
    try:
        running = asyncio.create_task(engine.generate(make_request("running", size=32)))
        await wait_until_forward_started(pipeline)
        queued = asyncio.create_task(engine.generate(make_request("queued")))
        await until(lambda: engine.scheduler.num_waiting == 1, "the request is queued")
        queued.cancel()
        with pytest.raises(asyncio.CancelledError):
            await queued
        assert engine.scheduler.num_waiting == 0
        pipeline.gate.set()
        await running
    finally:
        await engine.stop()
    assert pipeline.forwards == [["running"]]
    assert engine.stats.requests_aborted == 1


async def test_abort_of_a_running_request_drops_its_result(pipeline: FakePipeline) -> None:
    pipeline.gate = threading.Event()
    engine = await started(pipeline, max_num_seqs=8)
    try:
        task = asyncio.create_task(engine.generate(make_request("a")))
        await wait_until_forward_started(pipeline)
        assert engine.abort("a") is True
        with pytest.raises(RequestAbortedError):
            await task
        pipeline.gate.set()
        # The engine keeps serving after dropping the result.
        output = await engine.generate(make_request("b"))
    finally:
        await engine.stop()
    assert output.request_id == "b"
    assert engine.abort("unknown") is False


async def test_a_batch_whose_requests_are_all_aborted_stops_at_its_next_step() -> None:
    pipeline = FakeDenoisingPipeline()
    engine = await started(pipeline, max_num_seqs=8, request_batch_max_wait_ms=1000)
    observer = RecordingObserver()
    engine.observers.append(observer)
    try:
        tasks = [asyncio.create_task(engine.generate(make_request(rid, steps=100))) for rid in ("a", "b")]
        await wait_until_forward_started(pipeline)
        for task in tasks:  # their clients go away
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        pipeline.permits.release(1000)
        # The engine is free again long before the 100 steps.
        output = await engine.generate(make_request("next", steps=1))
    finally:
        await engine.stop()
    assert output.request_id == "next"
    assert pipeline.steps_taken == 1 + 1  # one step of the abandoned batch, one of "next"
    assert [r.interrupted for r in observer.forwards] == [True, False]


async def test_a_batch_runs_on_while_one_of_its_requests_still_wants_it() -> None:
    pipeline = FakeDenoisingPipeline()
    engine = await started(pipeline, max_num_seqs=8, request_batch_max_wait_ms=1000)
    try:
        gone = asyncio.create_task(engine.generate(make_request("gone", steps=3)))
        kept = asyncio.create_task(engine.generate(make_request("kept", steps=3)))
        await wait_until_forward_started(pipeline)
        gone.cancel()
        pipeline.permits.release(1000)
        output = await kept
    finally:
        await engine.stop()
    assert output.request_id == "kept" and pipeline.steps_taken == 3


async def test_stopping_the_engine_interrupts_the_running_forward() -> None:
    pipeline = FakeDenoisingPipeline()
    engine = await started(pipeline)
    task = asyncio.create_task(engine.generate(make_request("a", steps=100)))
    await wait_until_forward_started(pipeline)
    stopping = asyncio.create_task(engine.stop())
    await asyncio.sleep(0)  # stop() has set the interrupt before the permits come
    pipeline.permits.release(1000)
    await stopping
    with pytest.raises(EngineNotRunningError):
        await task
    assert pipeline.steps_taken == 1


async def test_input_images_held_by_requests_in_progress_are_bounded() -> None:
    pipeline = FakeInputPipeline()
    pipeline.gate = threading.Event()
    engine = await started(pipeline, max_input_bytes=3000)
    image = np.zeros((20, 20, 3), dtype=np.uint8)  # 1200 bytes

    def with_image(request_id: str) -> GenerationRequest:
        return replace(make_request(request_id), input_images=(image,))

    try:
        running = [engine.submit(with_image(rid)) for rid in ("a", "b")]
        assert engine.input_bytes == 2400
        with pytest.raises(QueueFullError, match="input images"):
            engine.submit(with_image("c"))
        pipeline.gate.set()
        await asyncio.gather(*(handle.result() for handle in running))
        assert engine.input_bytes == 0
        assert (await engine.submit(with_image("c")).result()).request_id == "c"
    finally:
        await engine.stop()


class ReducingPipeline(FakePipeline):
    """Records the requests `reduce_inputs` sees."""

    def __init__(self) -> None:
        super().__init__()
        self.reduced: list[str] = []

    def reduce_inputs(self, request: GenerationRequest) -> GenerationRequest:
        self.reduced.append(request.request_id)
        return request


async def test_inputs_of_any_kind_are_prepared_before_they_queue() -> None:
    # A controlled video may bring a control video and mask without images: they are inputs
    # to reduce too (`GenerationRequest.has_inputs`), a prompt alone is not.
    pipeline = ReducingPipeline()
    engine = await started(pipeline)
    video = np.zeros((5, 16, 16, 3), dtype=np.uint8)
    try:
        controlled = replace(make_request("video"), control_video=video)
        image = replace(make_request("image"), input_images=(video[0],))
        for request in (make_request("prompt"), controlled, image):
            await engine.prepare_inputs(request)
    finally:
        await engine.stop()
    assert pipeline.reduced == ["video", "image"]
    assert controlled.has_inputs and not make_request("x").has_inputs


async def test_a_batch_that_runs_out_of_memory_is_split_and_its_shape_capped() -> None:
    pipeline = FakeMemoryPipeline(fits=2)
    engine = await started(pipeline, max_num_seqs=4, request_batch_max_wait_ms=1000)
    observer = RecordingObserver()
    engine.observers.append(observer)
    try:
        first = await asyncio.gather(*(engine.generate(make_request(f"a{i}")) for i in range(4)))
        second = await asyncio.gather(*(engine.generate(make_request(f"b{i}")) for i in range(4)))
    finally:
        await engine.stop()
    assert len(first) == len(second) == 4  # nobody failed
    # 4 ran out of memory and was retried in halves; after that, batches of 2 only.
    assert pipeline.attempts == [4, 2, 2, 2, 2]
    assert [r.out_of_memory for r in observer.forwards] == [True, False, False, False, False]


async def test_deadline_passed_while_waiting(pipeline: FakePipeline) -> None:
    pipeline.gate = threading.Event()
    engine = await started(pipeline, max_num_seqs=8)
    try:
        running = asyncio.create_task(engine.generate(make_request("running", size=32)))
        await wait_until_forward_started(pipeline)
        late = GenerationRequest.create("a cat", SamplingParams(width=64, height=64), timeout_s=0.05)
        with pytest.raises(DeadlineExceededError):
            await engine.generate(late)
        assert engine.scheduler.num_waiting == 0
        pipeline.gate.set()
        await running
    finally:
        await engine.stop()
    assert pipeline.forwards == [["running"]]


async def test_admission_errors(pipeline: FakePipeline) -> None:
    pipeline.gate = threading.Event()
    engine = await started(pipeline, max_num_seqs=1, max_queue_len=1)
    try:
        with pytest.raises(InvalidRequestError) as invalid:
            await engine.generate(make_request("big", size=2048))
        assert invalid.value.param == "width"
        running = asyncio.create_task(engine.generate(make_request("a")))
        await wait_until_forward_started(pipeline)
        waiting = asyncio.create_task(engine.generate(make_request("b")))
        await until(lambda: engine.num_waiting == 1, "b is queued")
        with pytest.raises(DuplicateRequestError):
            await engine.generate(make_request("a"))
        with pytest.raises(QueueFullError) as full:
            await engine.generate(make_request("c"))
        assert full.value.retry_after_s >= 1
        pipeline.gate.set()
        await asyncio.gather(running, waiting)
    finally:
        await engine.stop()
    with pytest.raises(EngineNotRunningError):
        await engine.generate(make_request("d"))


async def test_missing_seed_is_drawn_once_and_reported(pipeline: FakePipeline) -> None:
    engine = await started(pipeline)
    try:
        output = await engine.generate(make_request("a", seed=None, n=2))
    finally:
        await engine.stop()
    first, second = output.seeds
    assert second == first + 1
    assert output.images == (("a cat", first), ("a cat", second))


async def test_stop_fails_pending_requests(pipeline: FakePipeline) -> None:
    pipeline.gate = threading.Event()
    engine = await started(pipeline)
    task = asyncio.create_task(engine.generate(make_request("a")))
    await wait_until_forward_started(pipeline)
    pipeline.gate.set()
    await engine.stop()
    with pytest.raises(EngineNotRunningError):
        await task


class ProgressPipeline(FakePipeline):
    def forward(self, batch: RequestBatch) -> list[RequestOutput]:
        for step in (1, 2, 3):
            assert self.progress_callback is not None
            self.progress_callback(batch.request_ids, step, 3)
        return super().forward(batch)


class RecordingObserver:
    def __init__(self) -> None:
        self.progress: list[tuple[list[str], int, int]] = []
        self.started: list[list[str]] = []
        self.forwards: list[ForwardRecord] = []
        self.decodes: list[DecodeRecord] = []
        self.ended: dict[str, tuple[RequestTimeline, Exception | None]] = {}

    def on_batch_start(self, batch: RequestBatch, now: float) -> None:
        self.started.append(batch.request_ids)

    def on_forward(self, record: ForwardRecord) -> None:
        self.forwards.append(record)

    def on_decode(self, record: DecodeRecord) -> None:
        self.decodes.append(record)

    def on_moderation(self, record: ModerationRecord) -> None:
        pass

    def on_abort(self, request_id: str) -> None:
        pass

    def on_progress(self, request_ids: list[str], done: int, total: int) -> None:
        self.progress.append((request_ids, done, total))

    def on_request_end(
        self, request: GenerationRequest, timeline: RequestTimeline, error: Exception | None
    ) -> None:
        self.ended[request.request_id] = (timeline, error)


async def test_progress_reaches_observers_on_the_event_loop() -> None:
    engine = await started(ProgressPipeline())
    observer = RecordingObserver()
    engine.observers.append(observer)
    try:
        await engine.generate(make_request("a"))
        await asyncio.sleep(0)  # progress is delivered by call_soon_threadsafe
    finally:
        await engine.stop()
    assert observer.started == [["a"]]
    assert observer.progress == [(["a"], 1, 3), (["a"], 2, 3), (["a"], 3, 3)]
