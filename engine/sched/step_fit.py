"""Whether one more request fits beside the running ones at a step boundary: the step
scheduler's three bounds (`max_num_seqs` images, the step budget, the adapters the model
holds). Pure: no clock, no I/O."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from engine.request import GenerationRequest


class Sized(Protocol):
    """A request as the step scheduler holds it: the request and its step cost."""

    @property
    def request(self) -> GenerationRequest: ...

    @property
    def cost(self) -> int: ...


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
    cost = sum(e.cost for e in listed) + entry.cost
    if max_step_cost is not None and cost > max_step_cost:
        return False
    adapters = {a for a in (_adapter(e) for e in listed) if a is not None}
    adapter = _adapter(entry)
    new_adapter = adapter is not None and adapter not in adapters
    return not (new_adapter and max_adapters is not None and len(adapters) >= max_adapters)


def _adapter(entry: Sized) -> str | None:
    lora = entry.request.params.lora
    return None if lora is None else lora.name
