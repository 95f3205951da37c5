"""Whether one more request fits beside the running ones at a step boundary: the step
scheduler's three bounds (`max_num_seqs` images, the step budget, the adapters the model
holds), and what a group of requests costs in one step (`group_cost`). Pure: no clock, no I/O."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Protocol

from engine.request import GenerationRequest


class Costed(Protocol):
    """What a request adds to a step: its step cost, its rows' token grid where its step key
    leaves the size out (`PipelineSpec.step_grid`), else (), and whether its rows are packed
    beside other sizes rather than padded (`PipelineSpec.step_packs`)."""

    @property
    def cost(self) -> int: ...

    @property
    def grid(self) -> tuple[int, ...]: ...

    @property
    def packs(self) -> bool: ...


class Sized(Costed, Protocol):
    """A request as the step scheduler holds it: the request, its step cost and grid."""

    @property
    def request(self) -> GenerationRequest: ...


def fits(
    entry: Sized,
    running: Iterable[Sized],
    max_num_seqs: int,
    max_step_cost: int | None,
    max_adapters: int | None,
) -> bool:
    """Whether `entry` may run beside `running` (images, step cost, adapters)."""
    listed = list(running)
    if sum(e.request.params.n for e in listed) + entry.request.params.n > max_num_seqs:
        return False
    cost = group_cost([*listed, entry])
    if max_step_cost is not None and cost > max_step_cost:
        return False
    adapters = {a for a in (_adapter(e) for e in listed) if a is not None}
    adapter = _adapter(entry)
    new_adapter = adapter is not None and adapter not in adapters
    return not (new_adapter and max_adapters is not None and len(adapters) >= max_adapters)


def _adapter(entry: Sized) -> str | None:
    lora = entry.request.params.lora
    return None if lora is None else lora.name


def group_cost(entries: Iterable[Costed]) -> int:
    """The step cost of `entries` stepping together. Rows of different token grids (a family
    that mixes sizes in one forward) are packed end to end where every entry packs, costing
    their own; else padded to the grid that holds them all, the largest extent on each
    axis, so each costs its own cost scaled by the padded grid over its own: three requests
    of 16, 36 and 64 tokens cost 3 x 64, not 116."""
    listed = list(entries)
    grids = {entry.grid for entry in listed}
    if len(grids) < 2 or () in grids or all(entry.packs for entry in listed):
        return sum(entry.cost for entry in listed)
    padded = math.prod(max(axis) for axis in zip(*grids, strict=True))
    return sum(-(-entry.cost * padded // math.prod(entry.grid)) for entry in listed)
