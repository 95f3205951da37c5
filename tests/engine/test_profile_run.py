"""The profile run's budget search on a fake device: fixed memory plus a cost per budget
unit, running out of memory past the device's capacity (no torch, no GPU)."""

from __future__ import annotations

import pytest

from engine.profile_run import ProfileError, fit_budget, should_profile


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
