"""`step_together` on its own, with diffusers' flow-matching Euler scheduler and a denoiser
made of arithmetic (no model, milliseconds): requests at the same point of the same
schedule take one scheduler step together, others alone, and every request's latents are
bit for bit those of its steps alone; an unchanged group's conditioning is merged once."""

from __future__ import annotations

import numpy as np
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from engine.request import GenerationRequest, SamplingParams
from pipelines.stepping.state import Conditioning, DenoiseState, LastMerge, concatenate, step_together


def state(steps: int, seed: int) -> DenoiseState:
    scheduler = FlowMatchEulerDiscreteScheduler()
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps))
    scheduler.set_begin_index(0)
    latents = torch.randn((1, 16, 8), generator=torch.Generator().manual_seed(seed))
    request = GenerationRequest.create(f"p{seed}", SamplingParams(num_inference_steps=steps, seed=seed))
    cond = {"text": torch.full((1, 3), float(seed))}
    return DenoiseState.start(
        request, scheduler, latents, prompts=(cond, None), guidance_scale=1.0, generators=[]
    )


def denoise(
    _states: list[DenoiseState], latents: torch.Tensor, timesteps: torch.Tensor, cond: Conditioning
) -> torch.Tensor:
    # Each row's own: its latents, its timestep and its text.
    return torch.sin(latents) * timesteps[:, None, None] / 1000 + cond["text"].sum(dim=1)[:, None, None]


def run(states: list[DenoiseState]) -> None:
    while running := [s for s in states if not s.is_done]:
        step_together(running, denoise)


def test_rows_stepped_together_equal_their_steps_alone() -> None:
    # Two schedules of 4 steps (stepped together) and one of 6 (alone), joined at once.
    together = [state(4, 0), state(4, 1), state(6, 2)]
    run(together)
    for mine in together:
        alone = state(mine.total_steps, int(mine.request.prompt[1:]))
        run([alone])
        assert torch.equal(mine.latents, alone.latents)
        assert mine.scheduler.step_index == alone.scheduler.step_index == mine.total_steps


def test_a_joiner_at_another_point_of_the_schedule_steps_apart() -> None:
    first, joiner = state(4, 0), state(4, 1)
    step_together([first], denoise)
    run([first, joiner])  # `first` is one step ahead: their sigmas differ at every step
    for mine, seed in ((first, 0), (joiner, 1)):
        alone = state(4, seed)
        run([alone])
        assert torch.equal(mine.latents, alone.latents)


def test_an_unchanged_group_is_merged_once() -> None:
    merges = []

    def merge(conds: list[Conditioning]) -> Conditioning:
        merges.append(len(conds))
        return concatenate(conds)

    last, a, b = LastMerge(), {"text": torch.zeros(1, 3)}, {"text": torch.ones(1, 3)}
    first = last.merged(merge, [a, b])
    assert last.merged(merge, [a, b]) is first and merges == [2]
    assert torch.equal(last.merged(merge, [b])["text"], b["text"]) and merges == [2, 1]
    b["text"] = torch.full((1, 3), 2.0)  # a conditioning given new rows is merged again
    assert torch.equal(last.merged(merge, [b])["text"], b["text"]) and merges == [2, 1, 1]
