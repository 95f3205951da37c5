"""Where step mode decodes: the overlap policy (pure) and the runner decoding beside the
steps, with a fake pipeline whose decode the test holds (no timing)."""

from __future__ import annotations

import threading

import pytest

from engine.decoding import OverlapPolicy
from engine.step_scheduler import StepPlan
from engine.stepping import StepRunner
from tests.engine.fakes import FakeStepPipeline, make_request


def test_auto_decodes_beside_the_steps_only_when_a_decode_costs_more_than_a_step() -> None:
    policy = OverlapPolicy("auto")
    assert not policy.overlap(1)  # nothing measured yet: decode here once to learn
    policy.observe_step(0.020)
    assert not policy.overlap(1)
    policy.observe_decode(4, 0.040)  # 10 ms an image
    assert not policy.overlap(2) and policy.overlap(3)
    for _ in range(30):  # steps get cheap (a smaller group): decoding now stalls them more
        policy.observe_step(0.005)
    assert policy.overlap(1)


def test_on_and_off_do_not_measure() -> None:
    assert OverlapPolicy("on").overlap(1) and not OverlapPolicy("off").overlap(100)
    with pytest.raises(ValueError, match="decode_overlap"):
        OverlapPolicy("sometimes")  # type: ignore[arg-type]


def test_the_others_go_on_stepping_while_a_finished_request_is_decoded() -> None:
    pipeline = FakeStepPipeline()
    pipeline.finish_gate = threading.Event()
    runner = StepRunner(pipeline, decode_overlap="on")
    short, long = make_request("short", steps=1), make_request("long", steps=5)
    stepped_while_held = threading.Event()

    def release_after_the_long_requests_steps() -> None:
        # Every step of "long" runs while the decode of "short" is held at the gate.
        if pipeline.steps_taken.wait_for(5, timeout=10):
            stepped_while_held.set()
        pipeline.finish_gate.set()  # type: ignore[union-attr]

    releaser = threading.Thread(target=release_after_the_long_requests_steps)
    releaser.start()
    try:
        output = runner.run(StepPlan(join=(short, long), step=("short", "long")), threading.Event())
        while "long" not in output.outputs:
            more = runner.run(StepPlan(join=(), step=("long",)), threading.Event())
            output.outputs.update(more.outputs)
    finally:
        releaser.join()
        runner.close()
    assert stepped_while_held.is_set()
    assert pipeline.groups == [["short", "long"]] + [["long"]] * 4
    assert set(output.outputs) == {"short", "long"}
    assert pipeline.finished == [["short"], ["long"]]
