"""First-Block Cache per request inside a shared denoising step (issue 27, step mode).

diffusers' First-Block Cache (`diffusers.hooks.first_block_cache`) splits a transformer's
blocks into a head (the first) and the rest: the head always runs, and when its residual
(output - input) changed by less than a threshold since the last step that ran everything,
the rest is replaced by the residual they added then ("tail residual"). It decides once
for the whole batch. Here each request decides for itself, in the same forward: the head
runs on every row, each request compares its own rows' residual with its own previous one,
the requests that must compute run the rest of the blocks as a sub-batch, and the others
take their head output plus their own cached tail residual. So a request's image does not
depend on who shared its steps (to the batching tolerance; a decision can flip only where a
request's change sits within float rounding of its threshold).

A request's cache (`pipelines.cache.records.FirstBlockCache`) lives in its `DenoiseState`,
with residuals per kind of forward (`pipelines.cache.calls`: most families make one per step). A step's
`CachedStep` computes new caches, forward by forward (`CachedForward`), and `commit`s them
only once the whole step succeeded, as `step_together` commits its states, so a failed step
leaves every request as it was. The hooks on the blocks are in `pipelines.cache.block_hooks`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from pipelines.cache.calls import DenoiserCall
from pipelines.cache.records import FirstBlockCache, Residuals
from pipelines.cache.row_decisions import Segment, changes, rows_index

if TYPE_CHECKING:
    from pipelines.stepping.state import DenoiseState


class CachedStep:
    """One step of a group: each request's rows in the merged batch, and its new cache."""

    def __init__(self, states: Sequence[DenoiseState]) -> None:
        self.states = list(states)
        self.starts: list[int] = []
        start = 0
        for state in states:
            self.starts.append(start)
            start += state.rows
        self.rows = start
        self.pending: list[FirstBlockCache | None] = [state.cache for state in states]
        self.segments: list[Segment] = []  # every forward's, in order
        self.blocks_skipped = 0

    def forward(self, call: DenoiserCall, rest_blocks: int) -> CachedForward:
        """The segments of one forward that carries `call.rows` of the merged batch."""
        rows = call.rows if call.rows is not None else range(self.rows)
        position = {row: index for index, row in enumerate(rows)}
        segments = []
        for index, state in enumerate(self.states):
            own = [
                position[row]
                for row in range(self.starts[index], self.starts[index] + state.rows)
                if row in position
            ]
            if not own:
                continue
            if own != list(range(own[0], own[0] + len(own))):
                raise RuntimeError("first-block cache: a request's rows must be contiguous in a forward")
            cache = self.pending[index]
            entry = None if cache is None else cache.of(call.key)
            segments.append(Segment(own[0], own[0] + len(own), cache, entry, owner=index))
        self.segments.extend(segments)
        return CachedForward(self, segments, len(rows), call, rest_blocks)

    def commit(self) -> int:
        """Give each request its new cache; the blocks skipped in this step."""
        for state, cache in zip(self.states, self.pending, strict=True):
            state.cache = cache
        return self.blocks_skipped


class CachedForward:
    """One denoiser forward of a step: what the head decided, row by row."""

    def __init__(
        self, step: CachedStep, segments: list[Segment], rows: int, call: DenoiserCall, rest_blocks: int
    ) -> None:
        self.step = step
        self.segments = segments
        self.rows = rows
        self.call = call
        self.rest_blocks = rest_blocks
        self.head_output: tuple[Tensor, Tensor | None] | None = None
        self.compute_index: Tensor | None = None  # rows that run the rest (mixed forwards)
        self.grid_tokens = 0  # the head's image tokens (a grid's, with rows of several sizes)
        self._cut: dict[int, tuple[Tensor, Tensor]] = {}

    @property
    def all_compute(self) -> bool:
        return all(segment.compute for segment in self.segments)

    @property
    def all_skip(self) -> bool:
        return not any(segment.compute for segment in self.segments)

    def image(self, stream: Tensor) -> Tensor:
        """The image tokens of the image stream (Z-Image's rows carry their caption after)."""
        tokens = self.call.image_tokens
        return stream if tokens is None else stream[:, :tokens]

    def decide(self, hidden_in: Tensor, hidden_out: Tensor, second_out: Tensor | None) -> None:
        """Each cached request's skip decision from its own head residual, with one host sync
        for the whole forward (as diffusers' `.item()` is one per batch) and a fixed number of
        tensor operations however many requests compare: on a small model each operation
        costs more than its arithmetic, so a loop of them per request ate what skipping saved."""
        if hidden_out.shape[0] != self.rows:
            raise RuntimeError(
                f"first-block cache: a forward of {hidden_out.shape[0]} rows, expected {self.rows}"
            )
        self.head_output = (hidden_out, second_out)
        residual = self.image(hidden_out) - self.image(hidden_in)
        self.grid_tokens = residual.shape[1]
        compared = [s for s in self.segments if s.entry is not None and s.entry.tail is not None]
        if not compared or self.call.places is not None:  # rows of several sizes: their own tokens
            now = [self._own(residual[s.start : s.stop], s) for s in compared]
        elif sum(s.stop - s.start for s in compared) == self.rows:
            now = [residual]
        else:
            now = [residual.index_select(0, rows_index(compared, residual.device))]
        requests = len(self.step.states)
        change_of = changes(now, compared, requests, residual.device, self.call.summed)
        for segment in compared:
            cache = segment.cache
            assert cache is not None
            if change_of[segment.owner] <= cache.threshold:  # diffusers' rule
                segment.compute = False
                # The residual compared against stays the last computed step's (diffusers').
                self._update(
                    segment,
                    replace(
                        cache,
                        steps_skipped=cache.steps_skipped + 1,
                        blocks_skipped=cache.blocks_skipped + self.rest_blocks,
                    ),
                )
                self.step.blocks_skipped += self.rest_blocks
        for segment in self.segments:
            if segment.cache is not None and segment.compute:
                # Its own copy: a view would keep the whole forward's residual alive.
                whole = segment.stop - segment.start == self.rows and self.call.places is None
                rows = residual[segment.start : segment.stop]
                segment.head = residual if whole else self._own(rows, segment).clone()
        if not self.all_compute and not self.all_skip:
            self.compute_index = rows_index(self.segments, hidden_out.device, compute=True)

    def _own(self, rows: Tensor, segment: Segment) -> Tensor:
        """A segment's `rows` of a stream (image tokens, or text then image tokens) with only
        the request's own tokens, in its packed order (all of them where the rows share one
        size): what its residuals are kept and compared as, whoever shares its forwards."""
        index = self._own_index(segment, rows.shape[1], rows.device)
        return rows if index is None else rows.index_select(1, index)

    def _own_index(self, segment: Segment, length: int, device: torch.device) -> Tensor | None:
        """Where a segment's own tokens sit in a stream of `length` tokens: its places on the
        grid, after the tokens before the grid every row keeps (FLUX.2's last blocks take its
        text and image joined, the text first); None where the rows share one size."""
        if self.call.places is None:
            return None
        places = self.call.places[segment.start]
        before = length - self.grid_tokens
        if before == 0:
            return places
        return torch.cat([torch.arange(before, device=device), places + before])

    def _update(self, segment: Segment, cache: FirstBlockCache) -> None:
        segment.cache = cache
        self.step.pending[segment.owner] = cache

    def rows_of(self, value: Tensor, shared_after: bool = False) -> Tensor:
        """A per-row argument cut to the rows that compute (unchanged if already cut; with
        `shared_after`, rows past the batch's are kept for every row). Each tensor is cut
        once per forward: every block gets the same `temb`."""
        if self.compute_index is None or value.shape[0] < self.rows:
            return value
        if value.shape[0] > self.rows and not shared_after:
            return value
        kept = self._cut.get(id(value))
        if kept is None or kept[0] is not value:
            index = self.compute_index
            if value.shape[0] > self.rows:
                index = torch.cat([index, torch.arange(self.rows, value.shape[0], device=index.device)])
            kept = (value, value.index_select(0, index))
            self._cut[id(value)] = kept  # the original is held too, so its id stays its own
        return kept[1]

    def assemble(
        self, hidden: Tensor | None, second: Tensor | None, *, length: int, second_kept: bool
    ) -> tuple[Tensor, Tensor | None]:
        """The last block's output for every row: the computed rows as computed (`hidden`,
        `second`: the sub-batch, or None when nobody computed), the skipping ones as their
        head output plus their cached tail residual (`length`: the last block's stream's
        tokens). Records the computed requests' new tail residuals."""
        assert self.head_output is not None
        head_second = self.head_output[1]
        hiddens: list[Tensor] = []
        seconds: list[Tensor] = []
        offset = 0
        for segment in self.segments:
            rows = slice(segment.start, segment.stop)
            base = self._base(rows, length)
            if segment.compute:
                n = segment.stop - segment.start
                own_hidden = hidden[offset : offset + n]  # type: ignore[index]
                own_second = None if second is None else second[offset : offset + n]
                offset += n
                if segment.cache is not None:
                    assert segment.head is not None
                    tail = (
                        self._own(self.image(own_hidden) - self.image(base), segment),
                        None
                        if not second_kept or own_second is None or head_second is None
                        else own_second - head_second[rows],
                    )
                    self._update(
                        segment, segment.cache.with_residuals(self.call.key, Residuals(segment.head, tail))
                    )
            else:
                cached = segment.entry.tail  # type: ignore[union-attr]
                assert cached is not None
                own_hidden = self._plus(base, cached[0], self._own_index(segment, base.shape[1], base.device))
                own_second = None if head_second is None else head_second[rows]
                if own_second is not None and cached[1] is not None:
                    own_second = own_second + cached[1]
            hiddens.append(own_hidden)
            if own_second is not None:
                seconds.append(own_second)
        if self.all_compute and hidden is not None:
            return hidden, second  # nothing changed: exactly the blocks' own output
        merged = torch.cat(seconds) if len(seconds) == len(self.segments) else None
        return torch.cat(hiddens), merged

    def _base(self, rows: slice, length: int) -> Tensor:
        """The head's output of `rows` in the last block's layout. FLUX.2 joins its text and
        image streams for its single blocks: there the last block's stream is longer than
        the head's image stream, the text's tokens first."""
        assert self.head_output is not None
        head_hidden, head_second = self.head_output
        if length == head_hidden.shape[1] or head_second is None:
            return head_hidden[rows]
        if head_second.shape[1] + head_hidden.shape[1] != length:
            raise RuntimeError("first-block cache: the last block's stream is not the head's text and image")
        return torch.cat([head_second[rows], head_hidden[rows]], dim=1)

    def _plus(self, base: Tensor, residual: Tensor, own: Tensor | None) -> Tensor:
        """`base` with a request's tail residual added at its own tokens (`own`: its places
        on a grid of several sizes; else the first tokens, all of them but Z-Image's)."""
        if own is None and residual.shape[1] == base.shape[1]:
            return base + residual
        out = base.clone()  # Z-Image's: the residual of the image tokens, before the caption's
        if own is None:
            out[:, : residual.shape[1]] += residual
        else:
            out[:, own] += residual
        return out
