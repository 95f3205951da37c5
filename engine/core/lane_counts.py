"""What `/metrics` counts over an engine's lanes: each lane's busy time and units of work, the
worker processes' counts, the step schedulers' counters. Running totals (Prometheus
counters); a server of several models adds the unloaded models' to them
(`engine.models.engine_totals`)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from engine.core.lanes import Lane

# A worker process's counts (`WorkerStats`) that /metrics adds up over the workers.
WORKER_COUNTERS = ("restarts", "crashes", "segments_received")
# Counters the step schedulers keep (`engine.sched.step_scheduler`), read at each scrape.
STEP_COUNTERS = ("preemptions", "held_back_row_steps")


def lane_counts(lanes: Sequence[Lane]) -> dict[str, tuple[float, int]]:
    """Each lane's busy seconds and units of work, by its label."""
    return {lane.label: (lane.busy_s, lane.units) for lane in lanes}


def worker_counts(lanes: Sequence[Lane]) -> Counter[str]:
    """The worker processes' counts added up (empty for in-process workers)."""
    counts: Counter[str] = Counter()
    for stats in (getattr(lane.executor, "stats", None) for lane in lanes):
        if stats is not None:
            counts.update({name: getattr(stats, name) for name in WORKER_COUNTERS})
    return counts


def step_counter(lanes: Sequence[Lane], name: str) -> int:
    """One of STEP_COUNTERS so far, over `lanes`' step schedulers (step mode)."""
    return sum(getattr(lane.steps, name) for lane in lanes if lane.steps is not None)
