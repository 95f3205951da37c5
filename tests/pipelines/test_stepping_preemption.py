"""Preemption on a real tiny model: a request paused for several steps (its state kept by the
runner, untouched) resumes where it was, and every request's images match diffusers'
own pipeline call alone (within 1/255) — with stateful schedulers (a multistep history, an
ancestral scheduler's generator) that a pause must not disturb."""

from __future__ import annotations

import random
import threading
from collections import Counter, defaultdict
from dataclasses import replace
from typing import Any

import pytest
from diffusers import DPMSolverMultistepScheduler, EulerAncestralDiscreteScheduler

from engine.request import GenerationRequest, RequestOutput
from engine.sched.step_scheduler import StepScheduler
from engine.worker.stepping import StepRunner
from tests.pipelines.engines import difference
from tests.pipelines.stock import stock_output
from tests.pipelines.test_stepping import loaded, mixed_requests

pytestmark = pytest.mark.slow


def with_priority(request: GenerationRequest, priority: int, arrival: float) -> GenerationRequest:
    return replace(request, params=replace(request.params, priority=priority), arrival_time=arrival)


@pytest.mark.parametrize("scheduler_class", [EulerAncestralDiscreteScheduler, DPMSolverMultistepScheduler])
def test_a_paused_request_resumes_where_it_was_and_its_image_is_unchanged(scheduler_class: Any) -> None:
    pipeline = loaded("tiny-sd")
    original = pipeline.pipe.scheduler
    pipeline.pipe.scheduler = scheduler_class.from_config(original.config)
    try:
        mixed = mixed_requests(pipeline, random.Random(11))
        # Two images' room: "mid" and "low" run; "urgent" arrives after 3 steps and "low", the
        # worst, pauses until "urgent" is done (5 steps), then resumes.
        mid = with_priority(mixed[0], 5, 0.0)  # 8 steps, CFG
        low = with_priority(mixed[2], 10, 0.0)  # 13 steps, a negative prompt
        urgent = with_priority(mixed[4], 0, 1.0)  # 5 steps, no CFG
        outputs, paused, progress = serve(pipeline, [mid, low], urgent, arrives_at=3)
        assert paused == {low.request_id: 5}
        # From the step it was at: not prepared again, no step skipped or repeated.
        assert progress[low.request_id] == list(range(1, 14))
        for request in (mid, low, urgent):
            alone = stock_output(pipeline, request)
            got = outputs[request.request_id]
            assert got.seeds == alone.seeds
            for image, reference in zip(got.images, alone.images, strict=True):
                assert difference(image, reference) <= 1, request.request_id
    finally:
        pipeline.pipe.scheduler = original


def serve(
    pipeline: Any, first: list[GenerationRequest], late: GenerationRequest, arrives_at: int
) -> tuple[dict[str, RequestOutput], Counter[str], dict[str, list[int]]]:
    """What the engine does, one step per plan: the step scheduler plans, the runner keeps
    the states. Returns the outputs, how many plans each request spent paused, and the
    steps done each request reported, in order."""
    scheduler = StepScheduler(max_num_seqs=2, aging_s=100.0)
    runner = StepRunner(pipeline)
    attention = threading.Event()
    attention.set()  # back after every step, as if news came each time

    def add(request: GenerationRequest) -> None:
        scheduler.add(request, pipeline.step_key(request), pipeline.step_cost(request))

    for request in first:
        add(request)
    outputs: dict[str, RequestOutput] = {}
    paused: Counter[str] = Counter()
    progress: dict[str, list[int]] = defaultdict(list)
    for plans in range(100):
        if plans == arrives_at:
            add(late)
        plan = scheduler.schedule()
        if plan is None:
            break
        paused.update(
            rid for rid in (*(r.request_id for r in first), late.request_id) if scheduler.is_paused(rid)
        )
        result = runner.run(plan, attention)
        assert not result.errors, result.errors
        outputs.update(result.outputs)
        for request_id, (done, _) in result.progress.items():
            progress[request_id].append(done)
        scheduler.finish([*result.outputs, *result.errors])
    runner.close()
    assert scheduler.preemptions == 1 and not runner.states
    return outputs, paused, progress
