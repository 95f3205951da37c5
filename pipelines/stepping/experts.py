"""Two denoisers split at a boundary timestep (Wan 2.2 A14B's experts), step-level.

diffusers' loop runs `transformer` (the high-noise expert) with `guidance_scale` while the
timestep is at least `boundary_ratio x num_train_timesteps`, then `transformer_2` (the
low-noise expert) with `guidance_scale_2`. The expert is a pure function of a request's own
schedule, so each request switches at its own step (`ExpertState.switch_step`, counted once
at prepare). A step group keeps its step key whatever side of their boundaries its requests
are on: one iteration runs one forward per expert present over that expert's rows
(`by_expert`), and `step_together` guides and commits all of them together, so if either
forward raises no request has moved. The request's scheduler is NOT reset at the switch:
UniPC's multistep history carries the high-noise expert's predictions into the low-noise
expert's first updates, as the stock loop's single scheduler does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pipelines.cache.calls import denoiser_call
from pipelines.stepping.state import Conditioning, DenoiseState

# (expert, latent rows, per-row timesteps, conditioning) -> that expert's prediction.
ExpertForward = Callable[[int, torch.Tensor, torch.Tensor, Conditioning], torch.Tensor]

HIGH_NOISE = 0
LOW_NOISE = 1


@dataclass(eq=False)
class ExpertState(DenoiseState):
    """A request of a two-expert model: from `switch_step` of its own steps on, the
    low-noise expert with `guidance_scale_2` (`switch_guidance` moves the scale)."""

    switch_step: int = 0
    guidance_scale_2: float = 1.0

    @property
    def expert(self) -> int:
        return HIGH_NOISE if self.steps_done < self.switch_step else LOW_NOISE


def expert_state(state: DenoiseState, boundary_timestep: float, guidance_scale_2: float) -> ExpertState:
    """`state` (at its first step) as an `ExpertState`: its switch counted on its own
    timesteps (one host read per request, at prepare, never per step)."""
    fields = {name: getattr(state, name) for name in state.__dataclass_fields__}
    switched = ExpertState(**fields)
    switched.switch_step = int((state.timesteps >= boundary_timestep).sum())
    switched.guidance_scale_2 = guidance_scale_2
    if switched.switch_step == 0:  # every step below the boundary
        switched.guidance_scale = guidance_scale_2
    switched.after_step = switch_guidance
    return switched


def switch_guidance(state: DenoiseState) -> None:
    """After a scheduler step: at the switch, the low-noise expert's guidance scale."""
    assert isinstance(state, ExpertState)
    if state.steps_done == state.switch_step:
        state.guidance_scale = state.guidance_scale_2


def by_expert(
    states: list[Any],
    latents: torch.Tensor,
    timesteps: torch.Tensor,
    cond: Conditioning,
    forward: ExpertForward,
) -> torch.Tensor:
    """The prediction for every row of `states` (laid out as `step_together` merges them:
    each state's rows together), one `forward` per expert over its own rows. The row
    indices come from the states' step counts on the host: no device read."""
    experts = [state.expert for state in states for _ in range(state.rows)]
    # The expert is a phase of First-Block Cache: a request's residuals start again with it.
    if len(set(experts)) == 1:
        with denoiser_call(phase=experts[0]):
            return forward(experts[0], latents, timesteps, cond)
    predictions: list[tuple[torch.Tensor, torch.Tensor]] = []
    for expert in (HIGH_NOISE, LOW_NOISE):
        own = [i for i, e in enumerate(experts) if e == expert]
        rows = torch.tensor(own, device=latents.device)
        part = {name: value.index_select(0, rows) for name, value in cond.items()}
        times = timesteps.index_select(0, rows)
        with denoiser_call(own, phase=expert):
            predictions.append((rows, forward(expert, latents.index_select(0, rows), times, part)))
    first = predictions[0][1]
    out = first.new_empty((len(experts), *first.shape[1:]))
    for rows, prediction in predictions:
        out.index_copy_(0, rows, prediction)
    return out
