"""The profile run at start (issue 25 item 5), as vLLM does before it serves: run one step
group at the step budget and one decode at the decode budget on dummy inputs, read the
device's peak memory, and halve each budget until its run fits within
`--gpu-memory-utilization` of the device's memory.

The search is written against `MemoryGauge` so tests drive it with a fake device;
`pipelines.memory.gauge.CudaGauge`
is the real one (torch imported only there: the engine does not import torch), and the runs
are a `ProfileTarget` (`pipelines.memory.profile.StepProfile`: dummy requests through the
pipeline's own step stages). It runs where the pipeline lives, right after it loads
(`server.composition.measure_loaded`, in the server's thread or in each worker process); the
engine lowers its budgets to the result (`AsyncEngine.start`), and the server shows it in
/health and /metrics.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Literal, Protocol

from engine.worker.forward import is_out_of_memory

logger = logging.getLogger(__name__)

ProfileMode = Literal["auto", "on", "off"]
ProfileState = Literal["measured", "unmeasured", "skipped"]


class MemoryGauge(Protocol):
    def capacity(self) -> int:
        """The device's memory, bytes."""
        ...

    def reset_peak(self) -> None: ...

    def peak(self) -> int:
        """The most memory held since `reset_peak`, bytes."""
        ...


class ProfileError(RuntimeError):
    """Even a budget of 1 does not fit."""


@dataclass(frozen=True)
class Fitted:
    """A budget that fits, and the peak its run reached (bytes)."""

    budget: int
    peak: int


def should_profile(mode: ProfileMode, device: str) -> bool:
    """`auto` profiles on an accelerator only (on the CPU the run would cost minutes and
    the host's memory is not the server's alone to divide)."""
    return mode == "on" or (mode == "auto" and not device.startswith("cpu"))


def fit_budget(
    name: str, run: Callable[[int], None], budget: int, gauge: MemoryGauge, utilization: float
) -> Fitted:
    """The largest of `budget`, `budget // 2`, ... down to 1 whose run peaks within
    `utilization` of the device's memory; a run that runs out of memory does not fit.
    Halving, not a proportional guess: the fixed part of the peak (weights, the runtime)
    is unknown, so a smaller budget's peak is not a fraction of this one's."""
    limit = int(gauge.capacity() * utilization)
    while True:
        gauge.reset_peak()
        try:
            run(budget)
            peak: int | None = gauge.peak()
        except Exception as exc:
            if not is_out_of_memory(exc):
                raise
            peak = None
        if peak is not None and peak <= limit:
            return Fitted(budget, peak)
        if budget == 1:
            held = "ran out of memory" if peak is None else f"peaked at {peak} bytes"
            raise ProfileError(f"{name}: a budget of 1 {held}; the limit is {limit} bytes")
        budget //= 2


class ProfileTarget(Protocol):
    """The two runs, on dummy requests of the model's default size."""

    def request_cost(self) -> int:
        """The step cost of one dummy request (`Pipeline.step_cost`)."""
        ...

    def image_pixels(self) -> int:
        """Pixels of one decoded dummy image (frames x pixels of a video)."""
        ...

    def decode_images(self) -> int | None:
        """The images one decode may hold under `--decode-budget`, or None (no budget)."""
        ...

    def run_step(self, requests: int) -> None:
        """Prepare `requests` dummy requests and step them once, together."""
        ...

    def run_decode(self, images: int) -> None:
        """Decode `images` dummy images in one VAE call, not halved on running out."""
        ...

    def bound_decodes(self, pixels: int) -> None:
        """Make `pixels` the decode budget (`--decode-budget`) from now on."""
        ...


@dataclass(frozen=True)
class ProfilePlan:
    """What the run starts from (the configured budgets) and how; picklable, for a worker.
    `gauge` makes the gauge for a loaded pipeline instead of the device's own: tests give a
    fake one (the CPU has no device memory to read); it must be picklable too."""

    mode: ProfileMode = "auto"
    utilization: float = 0.9
    max_num_seqs: int = 8
    max_step_tokens: int | None = None
    gauge: Callable[[Any], MemoryGauge] | None = None


@dataclass(frozen=True)
class ProfileResult:
    """What the profile run found, for the engine (the budgets it lowers to), the log,
    /health and /metrics. `state`: measured (peaks read, budgets fitted), unmeasured (the
    runs ran, but this device has no memory gauge: budgets as configured) or skipped
    (`reason` says why). Budgets: requests per step group, step tokens (None: the engine's
    default, `max_num_seqs` default-size requests), decode budget (pixels); bytes: the
    step group's and the decode's peaks and the limit (`--gpu-memory-utilization` x the
    device's memory)."""

    state: ProfileState
    reason: str
    max_num_seqs: int | None = None
    max_step_tokens: int | None = None
    decode_budget: int | None = None
    step_peak: int | None = None
    decode_peak: int | None = None
    limit: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def tightest(results: list[ProfileResult]) -> ProfileResult | None:
        """One result for the engine from each worker's: the one with the fewest requests
        (every worker serves the same model; one scheduler limit must fit them all)."""
        measured = [r for r in results if r.state == "measured" and r.max_num_seqs is not None]
        if measured:
            return min(measured, key=lambda r: (r.max_num_seqs or 0, r.max_step_tokens or 0))
        return results[0] if results else None


def profile_at_start(
    plan: ProfilePlan, device: str, target: ProfileTarget | None, gauge: MemoryGauge | None
) -> ProfileResult:
    """Profile as `plan.mode` says: skipped (off; auto on the CPU; a pipeline that does not
    step on text alone); run without measuring where there is no gauge (the CPU, `on`: the
    runs prove the budgets run at all, and nothing is lowered on a guess); else measured
    and fitted (`run_profile`)."""
    if not should_profile(plan.mode, device):
        why = (
            "--profile-run off"
            if plan.mode == "off"
            else f"--profile-run auto profiles on an accelerator only; {device} is not one"
        )
        return _told(ProfileResult("skipped", why))
    if target is None:
        return _told(
            ProfileResult(
                "skipped",
                "the pipeline has no step stages for text-only requests (request level only, "
                "or its requests bring input images)",
            )
        )
    steps, images = _start(plan, target)
    if gauge is None:
        target.run_step(steps)
        target.run_decode(images)
        return _told(
            ProfileResult(
                "unmeasured",
                f"{device} has no memory gauge: one step group of {steps} requests and one decode "
                f"of {images} images ran; the budgets stay as configured",
            )
        )
    return _told(run_profile(plan, target, gauge))


def run_profile(plan: ProfilePlan, target: ProfileTarget, gauge: MemoryGauge) -> ProfileResult:
    """One step group at the step budget (`max_num_seqs` default-size requests, fewer where
    `max_step_tokens` holds fewer), halved until its peak fits; then one decode at the
    decode budget (`--decode-budget`, else a full step group's images), halved likewise.
    A step group that did not fit lowers both `max_num_seqs` and `max_step_tokens`."""
    cost = target.request_cost()
    start, _ = _start(plan, target)
    step = fit_budget("step group", target.run_step, start, gauge, plan.utilization)
    max_num_seqs, tokens = plan.max_num_seqs, plan.max_step_tokens
    if step.budget < start:
        max_num_seqs, tokens = min(max_num_seqs, step.budget), step.budget * cost
    # Without --decode-budget: what one finish of a full (fitted) step group decodes.
    images = target.decode_images() or max_num_seqs
    decode = fit_budget("decode", target.run_decode, images, gauge, plan.utilization)
    budget = decode.budget * target.image_pixels()
    target.bound_decodes(budget)
    limit = int(gauge.capacity() * plan.utilization)
    return ProfileResult(
        "measured",
        f"fitted within {plan.utilization:g} of the device's memory",
        max_num_seqs=max_num_seqs,
        max_step_tokens=tokens,
        decode_budget=budget,
        step_peak=step.peak,
        decode_peak=decode.peak,
        limit=limit,
    )


def _start(plan: ProfilePlan, target: ProfileTarget) -> tuple[int, int]:
    """The budgets as configured: requests in one step group, images in one decode."""
    steps = plan.max_num_seqs
    if plan.max_step_tokens is not None:
        steps = max(1, min(steps, plan.max_step_tokens // max(1, target.request_cost())))
    return steps, target.decode_images() or plan.max_num_seqs


def _told(result: ProfileResult) -> ProfileResult:
    details = ", ".join(
        f"{k}={v}" for k, v in result.as_dict().items() if v is not None and k not in ("state", "reason")
    )
    logger.info("profile run %s: %s%s", result.state, result.reason, f" ({details})" if details else "")
    return result
