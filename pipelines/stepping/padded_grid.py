"""Rows of different image sizes in one transformer forward, for the families whose
transformer takes one set of image positions for the whole batch (FLUX.1, Chroma, FLUX.2):
every row is laid on the grid that holds them all (the tallest by the widest), its token
(r, c) at place (r, c), so the shared positions give each row its own image's rotary
embedding, and a mask over the grid's empty places keeps every token from attending to them.

Only attention mixes tokens in these transformers (modulation is per row, the rest per
token), so each row's tokens compute what they compute alone; the empty places' outputs are
dropped (`gather`). `step_together` hands the rows over with each row's own tokens first,
zero-padded to the longest (`pipelines.stepping.state.padded_cat`). First-Block Cache is
told each row's places (`own_tokens`), where a family says its blocks allow it
(`Family.caches_mixed_sizes`).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from pipelines.cache.calls import denoiser_call


class Gridded(Protocol):
    """A family that mixes sizes: its rows' token grid per request."""

    def token_grid(self, request: Any) -> tuple[int, ...]: ...


def row_grids(family: Gridded, states: list[Any]) -> list[tuple[int, ...]]:
    """The token grid of every row of `states` (a state's n images and negative rows)."""
    return [family.token_grid(state.request) for state in states for _ in range(state.rows)]


@dataclass(frozen=True, slots=True)
class PaddedGrid:
    """The grid of `rows` x `cols` tokens that holds every row of a forward, and where each
    row's own tokens go in it (`places`, one index tensor per row, in its packed order)."""

    rows: int
    cols: int
    places: tuple[Tensor, ...]
    mixed: bool  # rows of more than one size: padded, masked and gathered back

    @classmethod
    def of(cls, grids: list[tuple[int, ...]], device: torch.device) -> PaddedGrid:
        """The grid for rows of token grids `grids` ((height, width) each, one per row)."""
        rows, cols = max(grid[0] for grid in grids), max(grid[1] for grid in grids)
        place_of = {grid: _places(grid, cols, device) for grid in set(grids)}
        return cls(rows, cols, tuple(place_of[grid] for grid in grids), len(place_of) > 1)

    @property
    def tokens(self) -> int:
        return self.rows * self.cols

    def spread(self, latents: Tensor) -> Tensor:
        """(B, rows x cols, C): each row's tokens at their places, zeros elsewhere (the
        latents as they are where the rows share one size)."""
        if not self.mixed:
            return latents
        hidden = latents.new_zeros(latents.shape[0], self.tokens, latents.shape[2])
        for row, own in enumerate(self.places):
            hidden[row, own] = latents[row, : own.numel()]
        return hidden

    def image_mask(self) -> Tensor:
        """(B, rows x cols) bool: True at each row's own places."""
        device = self.places[0].device
        mask = torch.zeros(len(self.places), self.tokens, dtype=torch.bool, device=device)
        for row, own in enumerate(self.places):
            mask[row, own] = True
        return mask

    def attention_kwargs(self, text_tokens: int) -> dict[str, Any] | None:
        """The transformer's `joint_attention_kwargs` that hide the empty places from every
        query (a key mask over [text, image], every text token kept), or None where the rows
        share one size. diffusers' native backend takes a (B, keys) bool mask."""
        if not self.mixed:
            return None
        mask = self.image_mask()
        text = torch.ones(mask.shape[0], text_tokens, dtype=torch.bool, device=mask.device)
        return {"attention_mask": torch.cat([text, mask], dim=1)}

    def own_tokens(self) -> AbstractContextManager[None]:
        """The transformer's forward inside, as First-Block Cache must see it where rows of
        several sizes share it: each row's own places (`pipelines.cache.calls`), so a request
        decides, and keeps its residuals, by its own tokens whoever shares the grid."""
        return denoiser_call(places=self.places) if self.mixed else nullcontext()

    def gather(self, out: Tensor, tokens: int) -> Tensor:
        """(B, `tokens`, C): each row's own outputs first, as `spread` took them, zeros after."""
        if not self.mixed:
            return out[:, :tokens]
        result = out.new_zeros(out.shape[0], tokens, out.shape[2])
        for row, own in enumerate(self.places):
            result[row, : own.numel()] = out[row, own]
        return result


def _places(grid: tuple[int, ...], cols: int, device: torch.device) -> Tensor:
    """Where the tokens of a `grid` (rows, columns) image go in a grid `cols` wide, in their
    order (row-major, as the packed latents lay them out)."""
    height, width = grid
    place = torch.arange(height, device=device)[:, None] * cols + torch.arange(width, device=device)[None, :]
    return place.flatten()
