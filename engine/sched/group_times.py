"""The time of one step of a step group, as a function of the group's step cost, learnt per
step key from the steps the engine ran (admission by deadline in step mode,
`engine.sched.step_admission`).

Why not seconds per cost-step times the cost (`engine.sched.deadline_admission.StepRates`): the
rows of a group step together, and a step of N rows costs far less than N steps of one row
(on 2 CPU cores, 8 tiny-sd rows step ~2.6x faster per row than one; on a GPU more). A rate
learnt from the groups that ran is an average over their sizes, so it makes a lone request
look slow and a full group look fast.

The model: each key keeps a small table, the group's step cost -> a running mean of its
step time (a unit's wall time over the steps it took, what `StepRates` counts: decodes and
the loop's overhead included). The estimate for a cost is a least-squares line through the
table (`base + per_cost x cost`, neither below 0) where the table has two costs or more.
With a single entry, every other cost is in proportion to it (as `StepRates` does): below
it that is a lower bound (a smaller group is no slower per row than a larger one), so a
lone request is never refused as too slow "even alone" (a refusal told not to retry) from
a full group's time; the second cost measured replaces it with the line. Past the largest
cost measured the time grows in proportion from there: the gain of batching is counted as
far as it was seen, never more.

Pure: no clock, no I/O; what to learn is passed in.
"""

from __future__ import annotations

from collections import OrderedDict

from engine.request import BatchKey

# Weight of the newest step in a cost's running mean.
_EWMA_WEIGHT = 0.2
# Costs remembered per key (the least recently measured goes first), and keys remembered.
_COSTS_KEPT = 16
_KEYS_KEPT = 256


class GroupTimes:
    """Seconds per step of a group, by step key and the group's step cost."""

    def __init__(self) -> None:
        self._by_key: OrderedDict[BatchKey, OrderedDict[int, float]] = OrderedDict()

    def learn(self, key: BatchKey, cost: int, seconds: float) -> None:
        """A step of a group of `key` whose rows cost `cost` in all took `seconds`."""
        if cost <= 0 or seconds <= 0:
            return
        table = self._by_key.pop(key, None) or OrderedDict()
        mean = table.pop(cost, None)
        table[cost] = seconds if mean is None else mean + _EWMA_WEIGHT * (seconds - mean)
        if len(table) > _COSTS_KEPT:
            table.popitem(last=False)
        self._by_key[key] = table
        if len(self._by_key) > _KEYS_KEPT:
            self._by_key.popitem(last=False)

    def step_s(self, key: BatchKey, cost: int) -> float | None:
        """The estimated time of one step of a group of `key` costing `cost`; None when no
        group of `key` was measured."""
        table = self._by_key.get(key)
        if not table:
            return None
        return line_time(sorted(table.items()), cost)


def line_time(points: list[tuple[int, float]], cost: int) -> float:
    """The time at `cost` of the line fitted through `points` (cost, seconds), sorted by cost,
    in proportion past the largest cost (see the module docstring)."""
    top_cost, top_s = points[-1]
    if len(points) == 1:
        return top_s * cost / top_cost
    base, per_cost = _fit(points)
    if cost <= top_cost:
        return base + per_cost * cost
    return (base + per_cost * top_cost) * cost / top_cost


def _fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least squares `seconds = base + per_cost x cost`, neither below 0 (a line through 0
    when the base would be negative; a flat one when the slope would)."""
    n = len(points)
    mean_c = sum(c for c, _ in points) / n
    mean_s = sum(s for _, s in points) / n
    var = sum((c - mean_c) ** 2 for c, _ in points)
    per_cost = sum((c - mean_c) * (s - mean_s) for c, s in points) / var
    if per_cost < 0:
        return mean_s, 0.0
    base = mean_s - per_cost * mean_c
    if base < 0:
        return 0.0, sum(c * s for c, s in points) / sum(c * c for c, _ in points)
    return base, per_cost
