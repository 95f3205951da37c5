"""Where step mode decodes: the overlap policy (pure) and the runner decoding beside the
steps, with a fake pipeline whose decode the test holds (no timing)."""

from __future__ import annotations

import threading

import pytest

from engine.sched.step_plan import StepPlan
from engine.worker.decoding import OverlapPolicy
from engine.worker.stepping import StepRunner
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


def test_waiting_for_stragglers_is_worth_it_only_when_their_steps_cost_less_than_a_decode() -> None:
    policy = OverlapPolicy("off")
    assert not policy.worth_waiting(1)  # nothing measured yet
    policy.observe_step(0.004)
    policy.observe_decode(1, 0.010)  # decode-bound: a decode costs 2.5 steps
    assert policy.worth_waiting(1) and policy.worth_waiting(2) and not policy.worth_waiting(3)
    denoiser_bound = OverlapPolicy("off")
    denoiser_bound.observe_step(0.100)
    denoiser_bound.observe_decode(1, 0.010)
    assert not denoiser_bound.worth_waiting(1)


class _Fixed(OverlapPolicy):
    """A policy whose verdict the test sets (the runner times real steps otherwise)."""

    def __init__(self, worth: bool) -> None:
        super().__init__("off")
        self.worth = worth

    def worth_waiting(self, steps: int) -> bool:
        return self.worth


@pytest.mark.parametrize("decode_bound", [True, False])
def test_a_straggler_one_step_behind_is_decoded_with_its_group_on_a_decode_bound_model(
    decode_bound: bool,
) -> None:
    """Seven requests finish after 3 steps, one needs a 4th. Decode-bound: the seven wait
    that one step and all eight decode together (no decode of one image alone); otherwise
    the seven, more than those still stepping, decode at once."""
    pipeline = FakeStepPipeline()
    runner = StepRunner(pipeline)
    runner.policy = _Fixed(decode_bound)
    requests = [make_request(f"r{i}", steps=3) for i in range(7)] + [make_request("late", steps=4)]
    ids = tuple(r.request_id for r in requests)
    output = runner.run(StepPlan(join=tuple(requests), step=ids), threading.Event())
    while len(output.outputs) < len(ids):
        left = tuple(rid for rid in ids if rid not in output.outputs)
        output.outputs.update(runner.run(StepPlan(join=(), step=left), threading.Event()).outputs)
    if decode_bound:
        assert pipeline.finished == [list(ids)]
        assert pipeline.finished_after == [4]
    else:
        assert pipeline.finished == [list(ids[:7]), ["late"]]
        assert pipeline.finished_after == [3, 4]


class _Recording(OverlapPolicy):
    def __init__(self) -> None:
        super().__init__("on")
        self.steps: list[float] = []
        self.decodes: list[tuple[int, float]] = []

    def observe_step(self, seconds: float) -> None:
        self.steps.append(seconds)
        super().observe_step(seconds)

    def observe_decode(self, images: int, seconds: float) -> None:
        self.decodes.append((images, seconds))
        super().observe_decode(images, seconds)


def test_times_taken_while_a_decode_runs_beside_the_steps_are_not_learnt_from() -> None:
    """A decode beside the steps shares the device (the default CUDA stream) with them: its
    span holds step kernels and theirs hold its. Neither is measured as a step or a decode."""
    pipeline = FakeStepPipeline()
    pipeline.finish_gate = threading.Event()
    runner = StepRunner(pipeline, decode_overlap="on")
    policy = runner.policy = _Recording()
    short, long = make_request("short", steps=1), make_request("long", steps=5)

    def release_after_the_long_requests_steps() -> None:
        pipeline.steps_taken.wait_for(5, timeout=10)
        pipeline.finish_gate.set()  # type: ignore[union-attr]

    releaser = threading.Thread(target=release_after_the_long_requests_steps)
    releaser.start()
    try:
        output = runner.run(StepPlan(join=(short, long), step=("short", "long")), threading.Event())
        while "long" not in output.outputs:
            more = runner.run(StepPlan(join=(), step=("long",)), threading.Event())
            output.outputs.update(more.outputs)
            output.forwards.extend(more.forwards)
            output.decodes.extend(more.decodes)
    finally:
        releaser.join()
        runner.close()
    # Steps 2-5 ran while "short" was decoded beside them; the step of both did not.
    assert [record.shared for record in output.forwards] == [False, True, True, True, True]
    assert len(policy.steps) == 1
    # Both decodes ran beside the steps (`on`): recorded for metrics, not learnt from.
    assert [record.beside for record in output.decodes] == [True, True]
    assert policy.decodes == []


def test_a_decode_beside_the_steps_never_ends_a_newer_request_with_its_id() -> None:
    """A request dropped while its decode runs beside the steps, and joined again at once
    (retried on the same worker, or its id sent again): the old decode's output is not the
    new one's, which steps to its own end and leaves no state behind."""
    pipeline = FakeStepPipeline()
    pipeline.finish_gate = threading.Event()
    runner = StepRunner(pipeline, decode_overlap="on")
    news = threading.Event()
    news.set()  # each run returns after one step
    try:
        plan = StepPlan(join=(make_request("x", steps=1), make_request("y", steps=9)), step=("x", "y"))
        first = runner.run(plan, news)
        assert first.decoding == ["x"]
        again = make_request("x", steps=2)
        runner.run(StepPlan(join=(again,), step=("y", "x"), drop=("x",)), news)
        pipeline.finish_gate.set()
        stale = runner.run(StepPlan(join=(), step=()), threading.Event())  # waits for the old decode
        assert stale.outputs == {} and "x" in runner.states  # main: the old output ended x
        outputs: list[str] = []
        for _ in range(20):
            outputs += runner.run(StepPlan(join=(), step=("y", "x")), threading.Event()).outputs
            if {"x", "y"} <= set(outputs):
                break
    finally:
        runner.close()
    assert sorted(outputs) == ["x", "y"] and runner.states == {}
