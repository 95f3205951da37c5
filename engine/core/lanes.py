"""Lanes: the engine's workers (`--data-parallel-size`), and which one a request goes to.

A `Lane` is one executor (one pipeline on one device) and what the engine tracks of it:
its flags, the work it is running, and the time it has been busy. `choose_lane` is pure.

How requests reach lanes differs by batching mode, because what a lane keeps differs:

- **request-level**: a lane keeps nothing between batches, so all lanes pull whole batches
  from the ONE shared `Scheduler` whenever they are free. Batches are formed from every
  waiting request of a key, wherever it would have gone, so they are as full as the queue
  allows, and no request waits behind one busy lane while another is free.
- **step-level**: a lane keeps each running request's denoising state, so a request is
  routed to a lane when it is admitted and stays there: its own `StepScheduler` per lane.
  `choose_lane` keeps requests of one step key together (they share forwards) while that
  lane has room, but never leaves a lane idle while another works.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.executor.abstract import Executor
from engine.request import BatchKey, RequestBatch
from engine.sched.step_plan import StepPlan
from engine.sched.step_scheduler import StepScheduler
from engine.worker.stepping import Flag


@dataclass(eq=False, slots=True)
class Lane:
    index: int
    executor: Executor
    # Step mode: set when this lane's step scheduler has news (an arrival, an abort), so the
    # executor, which keeps stepping while nothing changes, comes back at the next boundary.
    attention: Flag
    # Request mode: set when every request of the running batch is aborted (or the engine
    # stops), so the forward stops at its next denoising step instead of running for nobody.
    interrupt: Flag
    # Step mode: the requests routed to this lane.
    steps: StepScheduler | None = None
    running: RequestBatch | StepPlan | None = None
    busy_s: float = 0.0
    units: int = 0
    # In a server of several models: the model whose engine it serves (in its metrics label).
    model: str | None = None

    @property
    def label(self) -> str:
        """How /metrics and /health name it: its index, after its model's name if any."""
        return str(self.index) if self.model is None else f"{self.model}/{self.index}"

    @property
    def healthy(self) -> bool:
        return self.executor.health() is None

    def load(self) -> LaneLoad:
        steps = self.steps
        if steps is None:
            return LaneLoad(frozenset(), 0, 0, self.healthy)
        return LaneLoad(steps.held_keys(), steps.held_cost, steps.num_held, self.healthy, steps.max_step_cost)


def workers_up(lanes: Sequence[Lane]) -> int:
    """How many of `lanes` have a worker that can run work now."""
    return sum(lane.healthy for lane in lanes)


@dataclass(frozen=True, slots=True)
class WorkerHealth:
    """What `/health` says of an engine's workers: how many it has, how many can run work,
    and why each other one cannot ("worker LABEL: reason"). Plain values, so that it
    crosses to the API processes (`--api-server-count`), where the lanes themselves do not."""

    workers: int
    up: int
    down: tuple[str, ...] = ()


def worker_health(lanes: Sequence[Lane]) -> WorkerHealth:
    down = []
    for lane in lanes:
        reason = lane.executor.health()  # read once: the count and the reasons agree
        if reason is not None:
            down.append(f"worker {lane.label}: {reason}")
    return WorkerHealth(len(lanes), len(lanes) - len(down), tuple(down))


@dataclass(frozen=True, slots=True)
class LaneLoad:
    """What routing needs of a lane: the step keys it holds, the step cost of its requests
    (waiting and running), how many requests it holds, whether its worker is up, and its
    step budget in force (each lane learns its own from running out of memory; None: no
    bound)."""

    keys: frozenset[BatchKey]
    cost: int
    requests: int
    healthy: bool = True
    budget: int | None = None


def choose_lane(loads: Sequence[LaneLoad], key: BatchKey, cost: int) -> int:
    """The lane a step-mode request joins.

    1. A healthy lane holding nothing: free capacity beats a bigger group (an idle device
       does no work at all; the next request of the key will find company here).
    2. A healthy lane already holding `key` whose held cost leaves room for this request
       within that lane's own budget: it joins their forwards. The least loaded such lane.
    3. Otherwise the least loaded healthy lane (by held cost, then requests, then index).
    A lane whose worker is down is chosen only when every lane is down (the request then
    waits for its restart, within its own deadline).
    """
    if not loads:
        raise ValueError("no lanes")
    candidates = [i for i, load in enumerate(loads) if load.healthy] or list(range(len(loads)))

    def least_loaded(indices: list[int]) -> int:
        return min(indices, key=lambda i: (loads[i].cost, loads[i].requests, i))

    idle = [i for i in candidates if loads[i].requests == 0]
    if idle:
        return idle[0]
    affine = [i for i in candidates if key in loads[i].keys and _has_room(loads[i], cost)]
    if affine:
        return least_loaded(affine)
    return least_loaded(candidates)


def _has_room(load: LaneLoad, cost: int) -> bool:
    return load.budget is None or load.cost + cost <= load.budget
