"""The per-request decisions of First-Block Cache in a shared step (`first_block.CachedForward`):
each request's rows in a forward's batch, and its relative change since its last computed
step, for a whole forward in a fixed number of tensor operations and one host sync."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

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


def changes(residual: Tensor, compared: list[Segment], rows: int) -> list[float]:
    """Each compared request's relative change of its head residual since its last computed
    step: mean |now - then| / mean |then| over its own rows, as diffusers' rule. The sums are
    taken per row on the device and per request here, in float64 on the host."""
    if not compared:
        return []
    previous = torch.cat([segment.entry.head for segment in compared])  # type: ignore[union-attr]
    now = residual
    if previous.shape[0] != rows:
        now = residual.index_select(0, rows_index(compared, residual.device))
    # Sums of absolute values per row (faster on a CPU than `vector_norm(ord=1)`).
    change = (now - previous).abs_().flatten(1).sum(1)
    sums = torch.stack([change, previous.abs().flatten(1).sum(1)]).tolist()  # the step's one sync
    result = []
    start = 0
    for segment in compared:
        stop = start + segment.stop - segment.start
        base = math.fsum(sums[1][start:stop])
        result.append(math.fsum(sums[0][start:stop]) / base if base > 0 else math.inf)
        start = stop
    return result


def rows_index(segments: Sequence[Segment], device: torch.device, compute: bool | None = None) -> Tensor:
    """The batch rows of `segments` (only those whose `compute` is `compute`, if given)."""
    rows = [
        row
        for segment in segments
        if compute is None or segment.compute == compute
        for row in range(segment.start, segment.stop)
    ]
    return torch.tensor(rows, device=device)
