"""What a request's cache acceleration keeps between its steps, in its `DenoiseState`: its
First-Block Cache residuals and its TaylorSeer series. Plain records, below both the step
machinery that updates them (`pipelines.cache.first_block`, `pipelines.cache.taylor_seer`) and
the state that holds them (`pipelines.stepping.state`)."""

from __future__ import annotations

import copy
from collections.abc import Hashable
from dataclasses import dataclass, field, replace

import torch
from diffusers.hooks.taylorseer_cache import TaylorSeerState
from torch import Tensor

CallKey = tuple[Hashable, Hashable, int | None]


@dataclass(frozen=True, slots=True)
class Residuals:
    """One kind of forward's residuals for one request's rows, of the last step of that kind
    that ran every block."""

    head: Tensor
    # The rest of the blocks' effect on the image stream's image tokens, and on the other
    # stream where it outlives the last block (LTX-2's audio); None until computed.
    tail: tuple[Tensor, Tensor | None] | None = None


@dataclass(frozen=True, slots=True)
class FirstBlockCache:
    """One request's cache, kept in its `DenoiseState` and dropped with it: its residuals
    per kind of forward (`DenoiserCall.key`), for its own rows only."""

    threshold: float
    residuals: dict[CallKey, Residuals] = field(default_factory=dict)
    steps_skipped: int = 0  # forwards whose rest of the blocks this request skipped
    blocks_skipped: int = 0

    def of(self, key: CallKey) -> Residuals | None:
        return self.residuals.get(key)

    def with_residuals(self, key: CallKey, residuals: Residuals) -> FirstBlockCache:
        """This cache with `key`'s residuals replaced; those of another phase (a denoiser the
        request has left: Wan 2.2's first expert) dropped."""
        kept = {k: v for k, v in self.residuals.items() if k[0] == key[0]}
        kept[key] = residuals
        return replace(self, residuals=kept)


# The series in float32 whatever the model's dtype (diffusers' default is bfloat16): it is one
# output per request, and differences of bfloat16 outputs lose most of their digits.
FACTORS_DTYPE = torch.float32


def computes(step: int, interval: int, warmup: int) -> bool:
    """Whether step `step` (from 0) runs the denoiser: diffusers' `TaylorSeerCacheHook` rule
    (every step before `warmup`, then the first of each `interval` steps after the one that
    follows the warm-up), without its `disable_cache_after_step`."""
    return step < warmup or (step - warmup - 1) % interval == 0


@dataclass(frozen=True, slots=True)
class TaylorSeerCache:
    """One request's series, kept in its `DenoiseState` and dropped with it."""

    interval: int
    warmup: int
    order: int
    # diffusers' state of the series; None until the request's first computed step.
    series: TaylorSeerState | None = None
    steps_skipped: int = 0
    blocks_skipped: int = 0
    # The module the series is of, and the request's step it started at (its schedule counts
    # from there); None before the request's first step.
    denoiser: torch.nn.Module | None = None
    start: int = 0

    def computes(self, step: int) -> bool:
        return self.series is None or computes(step - self.start, self.interval, self.warmup)

    def on(self, denoiser: torch.nn.Module, step: int) -> TaylorSeerCache:
        """This cache for a step that `denoiser` computes: where the request has changed
        denoiser (Wan 2.2's low-noise expert after the high-noise one), a new series from
        `step`, its warm-up included, as diffusers' hook on each expert counts its own calls;
        a series of one expert's outputs says nothing of the other's."""
        if denoiser is self.denoiser:
            return self
        return replace(self, series=None, denoiser=denoiser, start=step)

    def predict(self, step: int) -> Tensor:
        assert self.series is not None
        series = copy.copy(self.series)  # `predict` reads the step from the state
        series.current_step = step
        outputs: list[Tensor] = series.predict()
        return outputs[0]

    def learned(self, step: int, output: Tensor) -> TaylorSeerCache:
        """This cache with `output`, computed at `step`, added to its series."""
        if self.series is None:
            series = TaylorSeerState(taylor_factors_dtype=FACTORS_DTYPE, max_order=self.order)
        else:
            # `update` replaces what it changes except the outer dict of factors.
            series = copy.copy(self.series)
            series.taylor_factors = dict(self.series.taylor_factors)
        series.current_step = step
        series.update((output,))
        return replace(self, series=series)
