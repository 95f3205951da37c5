"""Moderation in the worker (`engine.worker.moderation`): the images of a group of requests
are checked together after decoding; a flagged request fails alone with ContentPolicyError,
its peers keep their images, a flagged preview is withheld, a failing checker lets nothing
through. Fake pipelines echo their prompts as images, so a fake checker judges prompts."""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

from engine.errors import ContentPolicyError, ForwardError
from engine.outputs import ModerationRecord
from engine.request import GenerationRequest, Moderation, RequestBatch
from engine.sched.step_plan import StepPlan
from engine.worker.forward import run_batch
from engine.worker.stepping import StepRunner
from tests.engine.fakes import FakePipeline, FakeStepPipeline, make_request


class PromptChecker:
    """Flags images whose prompt says RED at moderation "auto", only VERYRED at "low"."""

    def __init__(self, fails: bool = False) -> None:
        self.calls: list[list[Moderation]] = []
        self.fails = fails

    def flags(self, images: list[tuple[Any, ...]], levels: list[Moderation]) -> list[bool]:
        self.calls.append(levels)
        if self.fails:
            raise RuntimeError("the checker broke")
        word = {"auto": "RED", "low": "VERYRED"}
        return [
            any(word[level] in str(image[0]) for image in each)
            for each, level in zip(images, levels, strict=True)
        ]


def request(
    request_id: str, prompt: str, moderation: Moderation = "auto", **fields: Any
) -> GenerationRequest:
    made = make_request(request_id, prompt=prompt, **fields)
    return dataclasses.replace(made, params=dataclasses.replace(made.params, moderation=moderation))


def batch_of(*requests: GenerationRequest) -> RequestBatch:
    return RequestBatch(key=("k",), requests=requests)


def test_a_flagged_request_fails_alone_and_its_batch_peers_get_their_images() -> None:
    pipeline = FakePipeline()
    pipeline.safety_checker = checker = PromptChecker()
    result = run_batch(
        pipeline, batch_of(*(request(f"r{i}", "RED cat" if i == 2 else "a cat") for i in range(4)))
    )
    assert sorted(result.outputs) == ["r0", "r1", "r3"]
    assert isinstance(result.errors["r2"], ContentPolicyError)
    assert len(pipeline.forwards) == 1  # not a failure to isolate: the batch ran once
    assert checker.calls == [["auto"] * 4]  # the whole batch in one check
    assert result.moderations == [ModerationRecord("image", checked=4, flagged=1)]


def test_each_request_is_judged_at_its_own_level() -> None:
    pipeline = FakePipeline()
    pipeline.safety_checker = PromptChecker()
    result = run_batch(pipeline, batch_of(request("lenient", "RED cat", "low"), request("strict", "RED cat")))
    assert list(result.outputs) == ["lenient"] and isinstance(result.errors["strict"], ContentPolicyError)


def test_a_failing_checker_lets_no_image_through() -> None:
    pipeline = FakePipeline()
    pipeline.safety_checker = PromptChecker(fails=True)
    result = run_batch(pipeline, batch_of(request("a", "a cat"), request("b", "a dog")))
    assert not result.outputs and all(isinstance(e, ForwardError) for e in result.errors.values())


def test_without_a_checker_nothing_is_checked_or_counted() -> None:
    result = run_batch(FakePipeline(), batch_of(request("a", "RED cat")))
    assert list(result.outputs) == ["a"] and result.moderations == []


def test_step_level_checks_the_decoded_group_and_withholds_a_flagged_preview() -> None:
    pipeline = FakeStepPipeline()
    pipeline.safety_checker = PromptChecker()
    runner = StepRunner(pipeline)
    joining = (request("red", "RED cat", partial_images=1), request("peer", "a cat", partial_images=1))
    plan = StepPlan(join=joining, step=("red", "peer"))
    ended: dict[str, Any] = {}
    partials, moderations = [], []
    while len(ended) < 2:  # a run returns early with news (previews): step on until both end
        result = runner.run(plan, threading.Event())
        plan = StepPlan(join=(), step=tuple(rid for rid in ("red", "peer") if rid in runner.states))
        ended.update(result.outputs)
        ended.update(result.errors)
        partials.extend(result.partials)
        moderations.extend(result.moderations)
    assert pipeline.finished == [["red", "peer"]]  # decoded, so checked, together
    assert isinstance(ended["red"], ContentPolicyError) and not isinstance(ended["peer"], Exception)
    assert [(p.request_id, p.index) for p in partials] == [("peer", 0)]
    assert ModerationRecord("preview", checked=2, flagged=1) in moderations
    assert ModerationRecord("image", checked=2, flagged=1) in moderations
