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

Only the guided output is predicted, so any family that steps can take it: where a step is
several forwards (LTX-2's guidance passes) or one row holds several outputs (LTX-2's video and
audio latents joined), the series is of what the scheduler steps with, all of it. The family
names the module that computes a request's step (`Family.step_denoiser`): its blocks are what
a predicted step skips, and where it changes (Wan 2.2's experts, two different functions of
the latents) the request's series starts again, as diffusers' hooks keep one per expert.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from diffusers.hooks import TaylorSeerCacheConfig
from diffusers.hooks._common import _ALL_TRANSFORMER_BLOCK_IDENTIFIERS
from torch import Tensor

from engine.request import CacheChoice
from pipelines.cache.records import FACTORS_DTYPE, TaylorSeerCache

if TYPE_CHECKING:
    from pipelines.stepping.state import DenoiseState

# (a request's state) -> the module that computes its rows at its step (`Family.step_denoiser`).
DenoiserOf = Callable[["DenoiseState"], torch.nn.Module]
# A UNet's stages, counted as blocks where a transformer's are its `*blocks` lists.
_UNET_BLOCKS = ("down_blocks", "up_blocks")


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
        taylor_factors_dtype=FACTORS_DTYPE,
        use_lite_mode=True,
    )


def denoiser_blocks(denoiser: torch.nn.Module) -> int:
    """The blocks of `denoiser` that a predicted step skips: its transformer blocks (the lists
    diffusers' hooks know by name), or a UNet's down, mid and up blocks."""
    names = (*_ALL_TRANSFORMER_BLOCK_IDENTIFIERS, *_UNET_BLOCKS)
    blocks = sum(
        len(child)
        for name, child in denoiser.named_children()
        if name in names and isinstance(child, torch.nn.ModuleList)
    )
    return blocks + int(isinstance(getattr(denoiser, "mid_block", None), torch.nn.Module))


class TaylorSeerStep:
    """One step of a group: which requests compute and what the others' outputs are."""

    def __init__(self, states: Sequence[DenoiseState], denoiser_of: DenoiserOf) -> None:
        self.states = list(states)
        self.steps = [state.steps_done for state in states]
        # Each request's cache for this step (restarted where its denoiser changed), given to
        # its state only at `commit`.
        self.caches: list[TaylorSeerCache | None] = []
        self.known: list[Tensor | None] = []
        # Set by `learn`, given to the states by `commit`.
        self.pending: list[TaylorSeerCache | None] = []
        self.skipped = 0
        for state, step in zip(self.states, self.steps, strict=True):
            cache = state.taylor_seer
            if cache is not None:
                cache = cache.on(denoiser_of(state), step)
            self.caches.append(cache)
            computed = cache is None or cache.computes(step)
            self.known.append(None if computed or cache is None else cache.predict(step))

    @property
    def computing(self) -> list[DenoiseState]:
        """The states whose rows go through the denoiser this step."""
        return [state for state, known in zip(self.states, self.known, strict=True) if known is None]

    def learn(self, guided: Sequence[Tensor], blocks: Callable[[torch.nn.Module], int]) -> None:
        """Each request's new series, from its guided prediction of this step, and the
        denoiser blocks the step skipped (`blocks`: of one denoiser), kept until `commit`.
        Called before the step's states move (`step_together`'s `before_commit`): what may
        raise here (a series update allocates) must leave every request where it was, to be
        retried; `commit` only assigns."""
        self.pending = []
        self.skipped = 0
        for step, cache, known, output in zip(self.steps, self.caches, self.known, guided, strict=True):
            if cache is None:
                self.pending.append(None)
            elif known is None:
                self.pending.append(cache.learned(step, output))
            else:
                assert cache.denoiser is not None  # set by `on`
                count = blocks(cache.denoiser)
                self.pending.append(
                    replace(
                        cache,
                        steps_skipped=cache.steps_skipped + 1,
                        blocks_skipped=cache.blocks_skipped + count,
                    )
                )
                self.skipped += count

    def commit(self) -> int:
        """Give each request its new series (`learn`'s, once the step has succeeded); the
        denoiser blocks the step skipped."""
        for state, cache in zip(self.states, self.pending, strict=True):
            if cache is not None:
                state.taylor_seer = cache
        return self.skipped


class RowTaylorSeer:
    """Step mode's TaylorSeer over a family's denoisers (`denoiser_of` names the one of each
    request's step): the blocks a predicted step skips, counted."""

    def __init__(self, denoiser_of: DenoiserOf) -> None:
        self.denoiser_of = denoiser_of
        self.blocks_skipped = 0
        self._blocks: dict[torch.nn.Module, int] = {}

    def blocks(self, denoiser: torch.nn.Module) -> int:
        """The blocks of `denoiser` (counted once per module)."""
        if denoiser not in self._blocks:
            self._blocks[denoiser] = denoiser_blocks(denoiser)
        return self._blocks[denoiser]

    def step(self, states: Sequence[DenoiseState]) -> TaylorSeerStep | None:
        """This group's step, or None when no request of it uses TaylorSeer."""
        if all(state.taylor_seer is None for state in states):
            return None
        return TaylorSeerStep(states, self.denoiser_of)

    def learn(self, step: TaylorSeerStep | None, guided: Sequence[Tensor]) -> None:
        if step is not None:
            step.learn(guided, self.blocks)

    def commit(self, step: TaylorSeerStep | None) -> None:
        if step is not None:
            self.blocks_skipped += step.commit()
