"""Admission by deadline: refuse at once a request that cannot finish before its deadline
given the work ahead of it, instead of running it late.

Pure arithmetic over what the engine measures; no clock (callers pass how long is left), so
tests drive it with a fake one.

The model of the estimate. Work is counted in cost-steps: one denoising step of a request
costs its `step_cost` (rows x latent tokens, the unit of the step budget: `n` images, CFG
doubling the rows, frames for video). The time of a cost-step is learnt from the engine's
units of work (a batch, or a step iteration) that ran to their end (`StepRates`, an EWMA per
batch key, and one over every key for keys not seen yet), as the unit's wall time on its
worker over the cost-steps its forwards carried. The wall time, not the denoiser's: prompt
encodes, decodes and the loop's own overhead delay a request as much as its steps do (timing
the denoiser alone, step mode admitted a whole tiny-sd burst that then ran late). A
unit that steps nothing (decodes, frees) passes its time on to the next one that does.
Nothing is learnt until a first request has finished: its units pay the warm-up (lazy
allocations, kernel selection, the first decode), many times slower than the rest.
So a group of k rows is taken to step in k times the per-row time measured at the batch
sizes that really ran: the gain of batching is counted as far as it was seen, never more
(fuller batches than measured make the estimate high, never low).

A request's estimated finish, from now, is the work ahead of it spread over the workers
that take it, plus its own work:

    finish = HEADROOM x (sum(steps_left x cost x rate(key) for work ahead) / workers
                         + steps x cost x rate(own key))

Work ahead is every running request (its steps not yet done) and every paused or waiting
request its scheduler would serve before it (its own order: priority, deadline, fair
share). With nothing measured yet, every request is admitted. Refused: `finish` beyond the
time left; Retry-After is the excess (by then the work ahead has shrunk by that much, if
nothing better-ranked arrives), or, when even alone it could not finish in time, the time
until the work ahead is done and a hint that a retry will not help.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from engine.errors import DeadlineUnmeetableError
from engine.outputs import ForwardRecord
from engine.request import BatchKey
from engine.sched.group_times import GroupTimes

# Weight of the newest forward in the running means.
_EWMA_WEIGHT = 0.2
# Keys whose rate is remembered (the least recently measured goes first).
_KEYS_KEPT = 256
# The estimate is stretched by this much for what it does not see: the HTTP side (parsing
# requests, encoding answers) and other processes sharing the host's cores during a burst.
# Measured once, on 2 busy cores (noisy): 24 concurrent 8-step tiny-sd requests in step mode
# under a 4 s deadline: admission off, 24 ran past it; without headroom 8 served in time, 6
# refused, 10 late; with it 8 in time, 8 refused, 8 late.
HEADROOM = 1.2


@dataclass(frozen=True, slots=True)
class Work:
    """What one request still has to run: `steps` denoising steps of `cost` each, with `key`
    (and its rows' token grid where the key leaves the size out: `PipelineSpec.step_grid`)."""

    key: BatchKey
    cost: int
    steps: int
    grid: tuple[int, ...] = ()
    packs: bool = False  # packed beside other sizes (`PipelineSpec.step_packs`)


class StepRates:
    """Seconds per cost-step, learnt from units of work that ran to their end."""

    def __init__(self) -> None:
        self._by_key: OrderedDict[BatchKey, float] = OrderedDict()
        self.overall: float | None = None
        self._warm = False
        # Seconds of units that stepped nothing, for the next unit that does.
        self._pending_s = 0.0

    def learn(
        self,
        key: BatchKey,
        forwards: Iterable[ForwardRecord],
        cost_per_image: float,
        seconds: float,
        finished: bool = False,
    ) -> float | None:
        """A unit of work with `key` took `seconds` and ran `forwards`, over requests whose cost
        is `cost_per_image` per image; `finished`: it ended a request. Returns the seconds it
        learnt from (with those of units before it that stepped nothing), or None."""
        if not self._warm:
            self._warm = finished  # the warm-up lasts until a first request is done
            return None
        records = list(forwards)
        if any(not record.ok or record.interrupted for record in records):
            self._pending_s = 0.0
            return None  # failed or cut short: says little about what a step costs
        cost_steps = cost_per_image * sum(max(1, r.steps) * r.num_images for r in records)
        if cost_steps <= 0:
            self._pending_s += seconds
            return None
        seconds, self._pending_s = seconds + self._pending_s, 0.0
        rate = seconds / cost_steps
        self.overall = _mean(self.overall, rate)
        self._by_key[key] = _mean(self._by_key.pop(key, None), rate)
        if len(self._by_key) > _KEYS_KEPT:
            self._by_key.popitem(last=False)
        return seconds

    def rate(self, key: BatchKey) -> float | None:
        """Seconds per cost-step of `key`: its own if measured, else every key's; None before
        any forward was measured."""
        return self._by_key.get(key, self.overall)


def _mean(mean: float | None, value: float) -> float:
    return value if mean is None else mean + _EWMA_WEIGHT * (value - mean)


@dataclass(frozen=True, slots=True)
class Estimate:
    """Seconds, from now: the work ahead (spread over the workers) and the request's own."""

    ahead_s: float
    own_s: float

    @property
    def finish_s(self) -> float:
        return self.ahead_s + self.own_s


def estimate(ahead: Iterable[Work], own: Work, rates: StepRates, workers: int = 1) -> Estimate | None:
    """When a request doing `own` behind `ahead` is done, or None when nothing is measured."""
    own_rate = rates.rate(own.key)
    if own_rate is None:
        return None
    ahead_s = 0.0
    for work in ahead:
        ahead_s += work.steps * work.cost * (rates.rate(work.key) or own_rate)
    return Estimate(HEADROOM * ahead_s / max(1, workers), HEADROOM * own.steps * own.cost * own_rate)


def refusal(found: Estimate | None, time_left_s: float) -> DeadlineUnmeetableError | None:
    """The error refusing a request with `time_left_s` until its deadline, or None to admit."""
    if found is None or found.finish_s <= time_left_s:
        return None
    said = (
        f"the request cannot finish before its deadline: it would finish in about {found.finish_s:.1f} s "
        f"({found.ahead_s:.1f} s of work ahead of it, {found.own_s:.1f} s its own), but its deadline "
        f"is in {max(0.0, time_left_s):.1f} s"
    )
    if found.own_s > time_left_s:
        return DeadlineUnmeetableError(
            f"{said}; even alone it needs longer: ask for fewer steps or a longer timeout",
            retry_after_s=max(1.0, found.ahead_s),
            retry=False,
        )
    overshoot = found.finish_s - time_left_s
    return DeadlineUnmeetableError(
        f"{said}; retry after {max(1.0, overshoot):.0f} s", retry_after_s=max(1.0, overshoot)
    )


@dataclass(slots=True)
class _Held:
    key: BatchKey
    cost: int
    steps: int
    done: int = 0


class HeldWork:
    """The work of each request the engine holds (its key, cost and steps, and how many are
    done), and the step rates learnt from the forwards that ran them."""

    def __init__(self) -> None:
        self.rates = StepRates()
        # The time of a step by the group's cost (step mode's estimate, `engine.sched.step_admission`).
        self.groups = GroupTimes()
        self._held: dict[str, _Held] = {}

    def hold(self, request_id: str, work: Work) -> None:
        self._held[request_id] = _Held(work.key, work.cost, work.steps)

    def progress(self, request_id: str, done: int) -> None:
        held = self._held.get(request_id)
        if held is not None:
            held.done = max(held.done, done)

    def release(self, request_id: str) -> None:
        self._held.pop(request_id, None)

    def left(self, request_id: str) -> Work | None:
        """What `request_id` still has to run (None if not held)."""
        held = self._held.get(request_id)
        if held is None:
            return None
        return Work(held.key, held.cost, max(0, held.steps - held.done))

    def learn(
        self,
        key: BatchKey,
        request_ids: Iterable[str],
        images: int,
        forwards: list[ForwardRecord],
        *,
        seconds: float,
        finished: bool = False,
    ) -> None:
        """A unit of work with `key` over `request_ids` (`images` images) that ran `forwards`
        in `seconds`; `finished`: it ended a request."""
        cost = sum(held.cost for held in (self._held.get(rid) for rid in request_ids) if held is not None)
        learnt = self.rates.learn(key, forwards, cost / images if images > 0 else 0.0, seconds, finished)
        if learnt is not None and images > 0:
            # A unit steps its group several times (step mode: while nothing needs the
            # engine; request mode: every step of the batch), each step one forward of its
            # rows or two halves: its group steps are its row-steps over its rows.
            row_steps = sum(max(1, r.steps) * r.num_images for r in forwards)
            self.groups.learn(key, cost, learnt / max(1.0, row_steps / images))

    def step_s(self, key: BatchKey, cost: int) -> float | None:
        """One step of a group of `key` costing `cost`: as groups of `key` were measured, or
        else the learnt seconds per cost-step times `cost`; None before anything was."""
        measured = self.groups.step_s(key, cost)
        if measured is not None:
            return measured
        rate = self.rates.rate(key)
        return None if rate is None else rate * cost
