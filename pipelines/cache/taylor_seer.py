"""TaylorSeer per request inside a shared denoising step (issue 27, step mode).

diffusers' TaylorSeer (`diffusers.hooks.taylorseer_cache`) runs the model on some steps and,
on the steps between, predicts module outputs from a Taylor series: the last computed output
and its divided differences over the steps computed before it. Its lite mode predicts the
last projection, that is the denoiser's whole output; it keeps one schedule and one series
per cache context, so every row of a forward computes or predicts together. Here each
request keeps the series of its own guided denoiser output (what its scheduler steps with)
and follows its own schedule by its own step index: on a predicted step its rows stay out of
the forward and its output is its series' value at that step; the requests that compute run
the denoiser as a sub-batch (`step_together`'s `known`). So its image does not depend on who
shared its steps. The math is diffusers' `TaylorSeerState` (one per request, forked, never
changed in place, so a failed step leaves it as it was); the schedule is diffusers' rule.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
from diffusers.hooks import TaylorSeerCacheConfig
from diffusers.hooks._common import _ALL_TRANSFORMER_BLOCK_IDENTIFIERS
from diffusers.hooks.taylorseer_cache import TaylorSeerState
from torch import Tensor

from engine.request import CacheChoice

if TYPE_CHECKING:
    from pipelines.stepping.state import DenoiseState

# The series in float32 whatever the model's dtype (diffusers' default is bfloat16): it is one
# output per request, and differences of bfloat16 outputs lose most of their digits.
_FACTORS_DTYPE = torch.float32


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

    def computes(self, step: int) -> bool:
        return self.series is None or computes(step, self.interval, self.warmup)

    def predict(self, step: int) -> Tensor:
        assert self.series is not None
        series = copy.copy(self.series)  # `predict` reads the step from the state
        series.current_step = step
        outputs: list[Tensor] = series.predict()
        return outputs[0]

    def learned(self, step: int, output: Tensor) -> TaylorSeerCache:
        """This cache with `output`, computed at `step`, added to its series."""
        if self.series is None:
            series = TaylorSeerState(taylor_factors_dtype=_FACTORS_DTYPE, max_order=self.order)
        else:
            # `update` replaces what it changes except the outer dict of factors.
            series = copy.copy(self.series)
            series.taylor_factors = dict(self.series.taylor_factors)
        series.current_step = step
        series.update((output,))
        return replace(self, series=series)


def taylor_seer_cache(choice: CacheChoice | None) -> TaylorSeerCache | None:
    """A request's empty series, or None when it does not use TaylorSeer."""
    if choice is None or choice.mode != "taylorseer" or not choice.on:
        return None
    return TaylorSeerCache(choice.interval, choice.warmup, choice.order)


def whole_batch_config(choice: CacheChoice) -> TaylorSeerCacheConfig:
    """Request mode: diffusers' hooks in lite mode (the blocks skipped, the output projection
    predicted), the closest to step mode's prediction of the whole output."""
    return TaylorSeerCacheConfig(
        cache_interval=choice.interval,
        disable_cache_before_step=choice.warmup,
        max_order=choice.order,
        taylor_factors_dtype=_FACTORS_DTYPE,
        use_lite_mode=True,
    )


class TaylorSeerStep:
    """One step of a group: which requests compute and what the others' outputs are."""

    def __init__(self, states: Sequence[DenoiseState]) -> None:
        self.states = list(states)
        self.steps = [state.steps_done for state in states]
        self.known: list[Tensor | None] = []
        for state, step in zip(self.states, self.steps, strict=True):
            cache = state.taylor_seer
            computed = cache is None or cache.computes(step)
            self.known.append(None if computed or cache is None else cache.predict(step))

    @property
    def computing(self) -> list[DenoiseState]:
        """The states whose rows go through the denoiser this step."""
        return [state for state, known in zip(self.states, self.known, strict=True) if known is None]

    def commit(self, guided: Sequence[Tensor], blocks: int) -> int:
        """Give each request its new series, from its guided prediction of this step (once
        the step has succeeded); the denoiser blocks the step skipped."""
        skipped = 0
        for state, step, known, output in zip(self.states, self.steps, self.known, guided, strict=True):
            cache = state.taylor_seer
            if cache is None:
                continue
            if known is None:
                state.taylor_seer = cache.learned(step, output)
            else:
                state.taylor_seer = replace(
                    cache, steps_skipped=cache.steps_skipped + 1, blocks_skipped=cache.blocks_skipped + blocks
                )
                skipped += blocks
        return skipped


class RowTaylorSeer:
    """Step mode's TaylorSeer over one denoiser: the blocks a predicted step skips, counted."""

    def __init__(self, denoiser: torch.nn.Module) -> None:
        self.blocks = sum(
            len(child)
            for name, child in denoiser.named_children()
            if name in _ALL_TRANSFORMER_BLOCK_IDENTIFIERS and isinstance(child, torch.nn.ModuleList)
        )
        self.blocks_skipped = 0

    @staticmethod
    def step(states: Sequence[DenoiseState]) -> TaylorSeerStep | None:
        """This group's step, or None when no request of it uses TaylorSeer."""
        if all(state.taylor_seer is None for state in states):
            return None
        return TaylorSeerStep(states)

    def commit(self, step: TaylorSeerStep | None, guided: Sequence[Tensor]) -> None:
        if step is not None:
            self.blocks_skipped += step.commit(guided, self.blocks)
