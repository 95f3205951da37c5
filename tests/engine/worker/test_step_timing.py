"""Step-level stages timed on the device that runs them (`engine.worker.timing`), with a fake
device whose work runs only when the host waits for it: a step's record is its own device
time, not its launch, a decode's is not swollen by the steps queued before it, and the
runner never waits for the device between steps."""

from __future__ import annotations

import threading
from typing import Any

from engine.request import RequestOutput
from engine.sched.step_plan import StepPlan
from engine.worker.step_stages import StageRunner
from engine.worker.stepping import StepRunner
from engine.worker.timing import HostClock
from tests.engine.device_fakes import FakeDevice, FakeDeviceStepPipeline
from tests.engine.fakes import FakeStepPipeline, make_request


def test_steps_and_decodes_take_their_device_time_and_steps_never_wait() -> None:
    device = FakeDevice()
    runner = StepRunner(FakeDeviceStepPipeline(device, step_s=0.5, decode_s=0.25))
    result = runner.run(StepPlan(join=(make_request("a", steps=3, n=2),), step=("a",)), threading.Event())
    assert [f.seconds for f in result.forwards] == [0.5, 0.5, 0.5]
    assert [d.seconds for d in result.decodes] == [0.5]  # 2 images, not the steps' 1.5 before
    # Between steps the runner only asked; the one wait is the decode's own copy to the host.
    assert "synchronize" not in device.calls[: device.calls.index("finish")]
    assert device.calls.count("synchronize") == 1
    assert runner.policy.step_s == 0.5 and runner.policy.decode_s_per_image == 0.25


def test_step_times_the_device_has_not_reached_come_with_a_later_result() -> None:
    device = FakeDevice()
    runner = StepRunner(FakeDeviceStepPipeline(device, step_s=0.5, decode_s=0.25))
    attention = threading.Event()
    attention.set()  # an arrival: the run returns after one step
    first = runner.run(StepPlan(join=(make_request("a", steps=4),), step=("a",)), attention)
    assert first.progress == {"a": (1, 4)} and first.forwards == []
    assert "synchronize" not in device.calls
    rest = runner.run(StepPlan(join=(), step=("a",)), threading.Event())
    assert [f.seconds for f in rest.forwards] == [0.5] * 4 and list(rest.outputs) == ["a"]


def test_a_pipeline_without_a_device_timer_is_timed_by_the_host_clock() -> None:
    assert isinstance(StageRunner(FakeStepPipeline()).timer, HostClock)


class FaultyDecodePipeline(FakeDeviceStepPipeline):
    """Its decode leaves the device in error: the next wait for the device raises."""

    def finish(self, states: list[Any]) -> list[RequestOutput]:
        outputs = super().finish(states)
        self.device.fault = RuntimeError("CUDA error: an illegal memory access was encountered")
        return outputs


def test_a_device_error_reading_a_decodes_time_fails_that_decodes_requests() -> None:
    device = FakeDevice()
    runner = StepRunner(FaultyDecodePipeline(device, step_s=0.5, decode_s=0.25))
    plan = StepPlan(join=(make_request("a", steps=2),), step=("a",))
    result = runner.run(plan, threading.Event())  # main: raises
    assert list(result.errors) == ["a"] and result.outputs == {} and runner.states == {}
    assert [d.ok for d in result.decodes] == [False]


def test_a_device_error_reading_a_steps_time_fails_that_steps_requests() -> None:
    device = FakeDevice()
    runner = StepRunner(FakeDeviceStepPipeline(device, step_s=0.5, decode_s=0.25))
    news = threading.Event()
    news.set()  # the run returns after one step, its time not yet read
    runner.run(StepPlan(join=(make_request("a", steps=4), make_request("b", steps=4)), step=("a", "b")), news)
    device.fault = RuntimeError("CUDA error: an illegal memory access was encountered")
    result = runner.run(StepPlan(join=(), step=("a", "b")), threading.Event())  # main: raises
    assert set(result.errors) == {"a", "b"} and runner.states == {}
