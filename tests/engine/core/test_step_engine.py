"""The engine in step-level batching, with a fake stepping pipeline in a real executor thread.

Steps are held by permits the test releases one at a time, so nothing depends on how fast
the machine is: the test waits for a state, it never sleeps for one.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from engine.core.config import EngineConfig
from engine.core.engine import AsyncEngine
from engine.errors import DeadlineExceededError, ForwardError, RequestAbortedError
from engine.executor.thread_executor import ThreadExecutor
from engine.request import GenerationRequest, PartialImage, RequestOutput, SamplingParams
from engine.sched.step_plan import StepPlan
from engine.sched.step_scheduler import StepScheduler
from engine.worker.decoding import OverlapPolicy
from engine.worker.stepping import MAX_FINISH_WAIT_STEPS, StepRunner
from tests.engine.core.test_engine import RecordingObserver
from tests.engine.fakes import FakePipeline, FakeStepPipeline, make_request


@pytest_asyncio.fixture
async def pipeline() -> AsyncIterator[FakeStepPipeline]:
    fake = FakeStepPipeline()
    yield fake
    if fake.permits is not None:
        fake.permits.release(1000)


async def started(pipeline: FakePipeline, max_num_seqs: int = 8) -> AsyncEngine:
    engine = AsyncEngine(ThreadExecutor(lambda: pipeline), EngineConfig(max_num_seqs, batching="step"))
    await engine.start()
    return engine


async def next_step_entered(pipeline: FakeStepPipeline) -> None:
    """Wait until a step is held at its permit, then re-arm for the one after."""
    assert await asyncio.to_thread(pipeline.entered.wait, 10)
    pipeline.entered.clear()


def hold(pipeline: FakeStepPipeline) -> threading.Semaphore:
    pipeline.permits = threading.Semaphore(0)
    return pipeline.permits


async def test_requests_with_different_steps_share_steps_and_leave_when_done(
    pipeline: FakeStepPipeline,
) -> None:
    engine = await started(pipeline)
    try:
        outputs = await asyncio.gather(
            engine.generate(make_request("short", steps=1, guidance=1.0)),
            engine.generate(make_request("long", steps=3, guidance=7.5)),
        )
    finally:
        await engine.stop()
    assert engine.batching == "step"
    assert [o.request_id for o in outputs] == ["short", "long"]
    assert pipeline.groups == [["short", "long"], ["long"], ["long"]]
    assert pipeline.finished == [["short"], ["long"]]
    assert engine.stats.forward_sizes == {2: 1, 1: 2}


async def test_a_newcomer_joins_the_running_request_at_the_next_step(pipeline: FakeStepPipeline) -> None:
    permits = hold(pipeline)
    engine = await started(pipeline)
    try:
        first = asyncio.create_task(engine.generate(make_request("first", steps=3)))
        await next_step_entered(pipeline)  # first's step 1 is held
        second = asyncio.create_task(engine.generate(make_request("second", steps=1)))
        await asyncio.sleep(0)  # admitted while the step runs
        permits.release()
        await next_step_entered(pipeline)
        permits.release(10)
        await asyncio.gather(first, second)
    finally:
        await engine.stop()
    assert pipeline.groups == [["first"], ["first", "second"], ["first"]]


async def test_abort_frees_a_running_requests_share_at_the_next_step(pipeline: FakeStepPipeline) -> None:
    permits = hold(pipeline)
    engine = await started(pipeline)
    try:
        doomed = asyncio.create_task(engine.generate(make_request("doomed", steps=100)))
        peer = asyncio.create_task(engine.generate(make_request("peer", steps=3)))
        await next_step_entered(pipeline)
        assert engine.abort("doomed") is True
        with pytest.raises(RequestAbortedError):
            await doomed
        permits.release(10)
        await peer
    finally:
        await engine.stop()
    assert pipeline.groups == [["doomed", "peer"], ["peer"], ["peer"]]
    assert engine.scheduler.num_running == 0


async def test_a_deadline_takes_effect_at_the_next_step(pipeline: FakeStepPipeline) -> None:
    permits = hold(pipeline)
    engine = await started(pipeline)
    try:
        late = GenerationRequest.create(
            "a cat", SamplingParams(64, 64, num_inference_steps=50), timeout_s=0.05
        )
        task = asyncio.create_task(engine.generate(late))
        await next_step_entered(pipeline)  # held until the deadline has passed
        with pytest.raises(DeadlineExceededError):
            await task
        permits.release(10)
        after = await engine.generate(make_request("after", steps=1))
    finally:
        await engine.stop()
    assert after.request_id == "after"
    assert pipeline.groups == [[late.request_id], ["after"]]


async def test_one_failing_request_does_not_fail_the_others_in_its_steps(pipeline: FakeStepPipeline) -> None:
    engine = await started(pipeline)
    try:
        results = await asyncio.gather(
            engine.generate(make_request("ok1", steps=2)),
            engine.generate(make_request("bad", steps=2, prompt="please FAIL")),
            engine.generate(make_request("ok2", steps=2)),
            return_exceptions=True,
        )
    finally:
        await engine.stop()
    assert isinstance(results[1], ForwardError) and "marked request failed" in str(results[1])
    assert [getattr(r, "request_id", None) for r in (results[0], results[2])] == ["ok1", "ok2"]
    assert engine.stats.requests_failed == 1


async def test_requests_that_finish_close_together_are_decoded_together(pipeline: FakeStepPipeline) -> None:
    engine = await started(pipeline)
    try:
        await asyncio.gather(
            *(engine.generate(make_request(r, steps=s)) for r, s in [("a", 2), ("b", 2), ("c", 5)])
        )
    finally:
        await engine.stop()
    # a and b finish at step 2, as many as those still stepping: decoded at once, together.
    assert pipeline.finished == [["a", "b"], ["c"]]
    assert pipeline.finished_after == [2, 5]
    assert engine.stats.decode_sizes == {2: 1, 1: 1}


@pytest.mark.parametrize("decode_bound", [True, False])
async def test_a_lone_finisher_waits_a_bounded_number_of_steps_for_company_only_if_decode_bound(
    pipeline: FakeStepPipeline, monkeypatch: pytest.MonkeyPatch, decode_bound: bool
) -> None:
    # The fake's times are too small to say which kind of model it is: the test says.
    monkeypatch.setattr(OverlapPolicy, "worth_waiting", lambda self, steps: decode_bound)
    engine = await started(pipeline)
    try:
        steps = [("a", 1), ("b", 9), ("c", 9), ("d", 9)]
        await asyncio.gather(*(engine.generate(make_request(r, steps=s)) for r, s in steps))
    finally:
        await engine.stop()
    # a is done after step 1 while three still step. Decode-bound: it waits two more steps
    # for company, no longer; otherwise (a step costs more than decoding one image) at once.
    assert pipeline.finished == [["a"], ["b", "c", "d"]]
    assert pipeline.finished_after[0] == (1 + MAX_FINISH_WAIT_STEPS if decode_bound else 1)


async def test_running_requests_are_bounded_by_max_num_seqs(pipeline: FakeStepPipeline) -> None:
    engine = await started(pipeline, max_num_seqs=2)
    try:
        await asyncio.gather(*(engine.generate(make_request(f"r{i}", steps=2)) for i in range(3)))
    finally:
        await engine.stop()
    assert pipeline.groups[:2] == [["r0", "r1"], ["r0", "r1"]]
    assert pipeline.groups[2:] == [["r2"], ["r2"]]


async def test_progress_is_per_request(pipeline: FakeStepPipeline) -> None:
    engine = await started(pipeline)
    observer = RecordingObserver()
    engine.observers.append(observer)
    try:
        await asyncio.gather(
            engine.generate(make_request("a", steps=2)), engine.generate(make_request("b", steps=1))
        )
    finally:
        await engine.stop()
    assert observer.started == [["a", "b"]]
    assert observer.progress == [(["a"], 1, 2), (["b"], 1, 1), (["a"], 2, 2)]
    # Each finished request was decoded once (alone or with the other), and the observer heard.
    assert sum(d.num_requests for d in observer.decodes) == 2 and all(d.ok for d in observer.decodes)


async def test_a_pipeline_that_cannot_step_falls_back_to_request_batching() -> None:
    engine = await started(FakePipeline())
    try:
        output = await engine.generate(make_request("a"))
    finally:
        await engine.stop()
    assert engine.batching == "request" and output.request_id == "a"


async def collect(engine: AsyncEngine, request: GenerationRequest) -> list[Any]:
    return [event async for event in engine.submit(request).events()]


async def test_previews_stream_at_evenly_spaced_steps_before_the_output(pipeline: FakeStepPipeline) -> None:
    engine = await started(pipeline)
    try:
        previewed, plain = await asyncio.gather(
            collect(engine, make_request("a", steps=8, partial_images=3, n=2)),
            collect(engine, make_request("b", steps=8)),
        )
    finally:
        await engine.stop()
    *partials, output = previewed
    assert [(p.index, p.steps_done, p.total_steps) for p in partials] == [(0, 2, 8), (1, 4, 8), (2, 6, 8)]
    assert all(p.images == (("a cat", "preview", p.steps_done),) * 2 for p in partials)
    assert isinstance(output, RequestOutput) and output.request_id == "a"
    assert [type(e) for e in plain] == [RequestOutput]


async def test_fewer_steps_than_previews_send_fewer_previews(pipeline: FakeStepPipeline) -> None:
    engine = await started(pipeline)
    try:
        events = await collect(engine, make_request("a", steps=2, partial_images=3))
    finally:
        await engine.stop()
    assert [type(e) for e in events] == [PartialImage, RequestOutput]


async def test_a_failed_preview_is_skipped_and_the_request_still_finishes(pipeline: FakeStepPipeline) -> None:
    engine = await started(pipeline)
    try:
        failing, fine = await asyncio.gather(
            collect(engine, make_request("a", steps=4, partial_images=1, prompt="PREVIEWFAIL")),
            engine.generate(make_request("b", steps=4)),
        )
    finally:
        await engine.stop()
    assert [type(e) for e in failing] == [RequestOutput]
    assert fine.request_id == "b"


async def test_closing_the_event_stream_aborts_the_request(pipeline: FakeStepPipeline) -> None:
    permits = hold(pipeline)
    engine = await started(pipeline)
    try:
        events = engine.submit(make_request("a", steps=50, partial_images=3)).events(heartbeat_s=0.01)
        assert await anext(events) is None  # a heartbeat while the first step is held
        await events.aclose()
        assert not engine.scheduler.has_request("a")
        assert engine.stats.requests_aborted == 1
        permits.release(1000)
    finally:
        await engine.stop()


def test_without_a_listener_previews_ride_in_the_result_and_end_the_iteration() -> None:
    runner = StepRunner(FakeStepPipeline())
    request = make_request("a", steps=4, partial_images=1)
    first = runner.run(StepPlan(join=(request,), step=("a",)), threading.Event())
    assert [(p.request_id, p.index, p.steps_done) for p in first.partials] == [("a", 0, 2)]
    assert first.progress == {"a": (2, 4)} and not first.outputs  # returned at once, mid-way
    rest = runner.run(StepPlan(join=(), step=("a",)), threading.Event())
    assert not rest.partials and list(rest.outputs) == ["a"]


async def test_running_compute_is_bounded_by_max_step_tokens(pipeline: FakeStepPipeline) -> None:
    """A 64x64 request costs 8 x 8 latent tokens here: a budget of 128 lets two step at once."""
    engine = AsyncEngine(
        ThreadExecutor(lambda: pipeline), EngineConfig(8, batching="step", max_step_tokens=128)
    )
    await engine.start()
    try:
        await asyncio.gather(*(engine.generate(make_request(f"r{i}", steps=2)) for i in range(3)))
    finally:
        await engine.stop()
    assert pipeline.groups == [["r0", "r1"], ["r0", "r1"], ["r2"], ["r2"]]


async def test_the_default_budget_is_max_num_seqs_requests_of_the_default_size(
    pipeline: FakeStepPipeline,
) -> None:
    engine = await started(pipeline, max_num_seqs=4)
    try:
        scheduler = engine.scheduler
        assert isinstance(scheduler, StepScheduler) and scheduler.max_step_cost == 4 * 8 * 8
    finally:
        await engine.stop()
