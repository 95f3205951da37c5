"""The profile run's budget search on a fake device: fixed memory plus a cost per budget
unit, running out of memory past the device's capacity (no torch, no GPU)."""

from __future__ import annotations

import pytest

from engine.worker.profile_run import (
    ProfileError,
    ProfileMode,
    ProfilePlan,
    fit_budget,
    profile_at_start,
    should_profile,
)


class OutOfMemoryError(RuntimeError):
    """Named as torch's is: `is_out_of_memory` goes by the name."""


class FakeMemory:
    def __init__(self, capacity: int, fixed: int, per_unit: int) -> None:
        self.total, self.fixed, self.per_unit = capacity, fixed, per_unit
        self.held = self.high = fixed
        self.runs: list[int] = []

    def capacity(self) -> int:
        return self.total

    def reset_peak(self) -> None:
        self.high = self.held

    def peak(self) -> int:
        return self.high

    def run(self, budget: int) -> None:
        self.runs.append(budget)
        need = self.fixed + budget * self.per_unit
        if need > self.total:
            raise OutOfMemoryError("CUDA out of memory")
        self.high = max(self.high, need)


def test_a_budget_that_fits_is_kept_after_one_run() -> None:
    device = FakeMemory(capacity=100, fixed=10, per_unit=5)
    fitted = fit_budget("step", device.run, 16, device, utilization=0.9)
    assert (fitted.budget, fitted.peak, device.runs) == (16, 90, [16])


def test_a_budget_over_the_utilization_is_halved_until_it_fits() -> None:
    device = FakeMemory(capacity=100, fixed=10, per_unit=5)
    fitted = fit_budget("step", device.run, 64, device, utilization=0.5)
    # 64 and 32 run out of memory, 16 peaks at 90 > 50, 8 at 50.
    assert (fitted.budget, fitted.peak, device.runs) == (8, 50, [64, 32, 16, 8])


def test_nothing_fitting_is_an_error_naming_the_budget() -> None:
    device = FakeMemory(capacity=100, fixed=95, per_unit=10)
    with pytest.raises(ProfileError, match="decode: a budget of 1 ran out of memory; the limit is 90"):
        fit_budget("decode", device.run, 4, device, utilization=0.9)


def test_other_errors_are_not_taken_for_memory() -> None:
    def broken(budget: int) -> None:
        raise ValueError("a bug")

    device = FakeMemory(capacity=100, fixed=10, per_unit=5)
    with pytest.raises(ValueError, match="a bug"):
        fit_budget("step", broken, 4, device, utilization=0.9)


def test_auto_profiles_on_an_accelerator_only() -> None:
    assert should_profile("auto", "cuda:0") and not should_profile("auto", "cpu")
    assert should_profile("on", "cpu") and not should_profile("off", "cuda")


class FakeTarget:
    """Dummy runs on `FakeMemory`: a step holds `step_unit` per request, a decode
    `image_unit` per image."""

    def __init__(self, device: FakeMemory, step_unit: int, image_unit: int, decode_images: int | None = None):
        self.device, self.step_unit, self.image_unit = device, step_unit, image_unit
        self.configured_images = decode_images
        self.bound: int | None = None
        self.ran: list[tuple[str, int]] = []

    def request_cost(self) -> int:
        return 64

    def image_pixels(self) -> int:
        return 1000

    def decode_images(self) -> int | None:
        return self.configured_images

    def _hold(self, units: int) -> None:
        need = self.device.fixed + units
        if need > self.device.total:
            raise OutOfMemoryError("CUDA out of memory")
        self.device.high = max(self.device.high, need)

    def run_step(self, requests: int) -> None:
        self.ran.append(("step", requests))
        self._hold(requests * self.step_unit)

    def run_decode(self, images: int) -> None:
        self.ran.append(("decode", images))
        self._hold(images * self.image_unit)

    def bound_decodes(self, pixels: int) -> None:
        self.bound = pixels


def test_the_profile_lowers_requests_step_tokens_and_the_decode_budget_to_what_fits() -> None:
    device = FakeMemory(capacity=100, fixed=10, per_unit=0)
    target = FakeTarget(device, step_unit=25, image_unit=30)
    plan = ProfilePlan("on", utilization=0.9, max_num_seqs=8)
    result = profile_at_start(plan, "cuda:0", target, device)
    # 8 and 4 requests run out of memory; 2 hold 60 of the 90 allowed. The decode starts
    # at those 2 images: 70 fits.
    assert target.ran == [("step", 8), ("step", 4), ("step", 2), ("decode", 2)]
    assert (result.state, result.max_num_seqs, result.max_step_tokens) == ("measured", 2, 2 * 64)
    assert (result.decode_budget, result.step_peak, result.decode_peak, result.limit) == (2000, 60, 70, 90)
    assert target.bound == 2000


def test_budgets_that_fit_stay_and_a_configured_decode_budget_is_where_the_decode_starts() -> None:
    device = FakeMemory(capacity=1000, fixed=10, per_unit=0)
    target = FakeTarget(device, step_unit=20, image_unit=100, decode_images=16)
    plan = ProfilePlan("on", utilization=0.9, max_num_seqs=8, max_step_tokens=4 * 64)
    result = profile_at_start(plan, "cuda:0", target, device)
    # max_step_tokens holds 4 requests: the step group starts there, and fits.
    assert target.ran == [("step", 4), ("decode", 16), ("decode", 8)]
    assert (result.max_num_seqs, result.max_step_tokens, result.decode_budget) == (8, 4 * 64, 8000)


def test_without_a_gauge_the_runs_run_once_and_nothing_is_lowered_on_a_guess() -> None:
    device = FakeMemory(capacity=100, fixed=10, per_unit=0)
    target = FakeTarget(device, step_unit=1, image_unit=1)
    result = profile_at_start(ProfilePlan("on", max_num_seqs=8), "cpu", target, None)
    assert target.ran == [("step", 8), ("decode", 8)]
    assert result.state == "unmeasured" and "cpu has no memory gauge" in result.reason
    assert (result.max_num_seqs, result.decode_budget, target.bound) == (None, None, None)


@pytest.mark.parametrize(
    ("mode", "device", "reason"),
    [("off", "cuda:0", "--profile-run off"), ("auto", "cpu", "auto profiles on an accelerator only")],
)
def test_a_skipped_profile_says_why_and_runs_nothing(mode: ProfileMode, device: str, reason: str) -> None:
    target = FakeTarget(FakeMemory(capacity=100, fixed=10, per_unit=0), 1, 1)
    result = profile_at_start(ProfilePlan(mode), device, target, None)
    assert result.state == "skipped" and reason in result.reason and target.ran == []
