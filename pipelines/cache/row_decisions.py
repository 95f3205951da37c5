"""The per-request decisions of First-Block Cache in a shared step (`first_block.CachedForward`):
each request's rows in a forward's batch, and its relative change since its last computed
step, for a whole forward in a fixed number of tensor operations and one host sync (rows of
different sizes on one grid: one more per request, to take its own tokens)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from pipelines.cache.calls import Summed
from pipelines.cache.records import FirstBlockCache, Residuals


@dataclass(slots=True)
class Segment:
    """One request's rows in a forward's batch."""

    start: int
    stop: int
    cache: FirstBlockCache | None  # the request's, as this step has updated it so far
    entry: Residuals | None  # its residuals of this kind of forward
    owner: int  # the request's index in the step
    compute: bool = True
    head: Tensor | None = None  # its new head residual, where it computes


def changes(
    now: list[Tensor],
    compared: list[Segment],
    requests: int,
    device: torch.device,
    summed: Summed | None = None,
) -> dict[int, float]:
    """Each compared request's relative change of its head residual since its last computed
    step, by its index in the step: mean |now - then| / mean |then| over its own rows and
    tokens, as diffusers' rule. `now` holds the compared segments' residuals of this step:
    one tensor of all their rows in order, or one per segment where their tokens differ (rows
    of different sizes). The sums are taken per row, then per request in float64 on the
    device, `summed` with the lane's members that hold the request's other rows or tokens
    (each member then takes the same decision), and read with the forward's one host sync.
    In a lane they are summed even where this member compares nothing: the others may."""
    if not compared and summed is None:
        return {}
    totals = torch.zeros(2, requests, dtype=torch.float64, device=device)
    if compared:
        heads = [segment.entry.head for segment in compared]  # type: ignore[union-attr]
        pairs = [(now[0], torch.cat(heads))] if len(now) == 1 else list(zip(now, heads, strict=True))
        sums = torch.cat([_row_sums(current, previous) for current, previous in pairs], dim=1)
        owners = [segment.owner for segment in compared for _ in range(segment.start, segment.stop)]
        totals.index_add_(1, torch.tensor(owners, device=device), sums.to(torch.float64))
    if summed is not None:
        totals = summed(totals)
    change_of, base_of = totals.tolist()  # the forward's one sync
    return {
        s.owner: change_of[s.owner] / base_of[s.owner] if base_of[s.owner] > 0 else math.inf for s in compared
    }


def _row_sums(now: Tensor, previous: Tensor) -> Tensor:
    """(2, rows): each row's sum of |now - previous| and of |previous| (sums of absolute
    values: faster on a CPU than `vector_norm(ord=1)`)."""
    change = (now - previous).abs_().flatten(1).sum(1)
    return torch.stack([change, previous.abs().flatten(1).sum(1)])


def rows_index(segments: Sequence[Segment], device: torch.device, compute: bool | None = None) -> Tensor:
    """The batch rows of `segments` (only those whose `compute` is `compute`, if given)."""
    rows = [
        row
        for segment in segments
        if compute is None or segment.compute == compute
        for row in range(segment.start, segment.stop)
    ]
    return torch.tensor(rows, device=device)
