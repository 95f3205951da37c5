"""Step-level batching, the part every family shares: a request's denoising state, and one
denoising step taken by many requests in one denoiser forward.

Each request owns a copy of the pipeline's scheduler (schedulers keep per-run state: step
index, multistep history, `init_noise_sigma` after `set_timesteps`), its own latents and
generators, and its encoded prompt. A step concatenates every request's rows — its
negative rows first when it uses classifier-free guidance, then its positive rows — runs
the denoiser once with a per-row timestep, splits the prediction back, applies each
request's own guidance scale, and steps each request's own scheduler. Rows of a request
without guidance take the conditional prediction itself (`u + 1 * (c - u)` is not bitwise
`c`), so a request's image is the one the stock pipeline makes for it alone, within float
tolerance, whoever it shared its steps with.

A family supplies the rest: how to encode a request, call its denoiser and decode.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.request import GenerationRequest, RequestOutput

# Per-row conditioning of a denoiser call, by argument name; every tensor has one row per image.
Conditioning = dict[str, torch.Tensor]
# A request's encoded prompt: (positive rows, negative rows or None without guidance).
Encoded = tuple[Conditioning, Conditioning | None]
# (latent rows, per-row timesteps, conditioning) -> the denoiser's prediction for each row.
Denoiser = Callable[[torch.Tensor, torch.Tensor, Conditioning], torch.Tensor]


@dataclass(eq=False)
class DenoiseState:
    """One request between its steps. `uncond` is None when it takes no guidance."""

    request: GenerationRequest
    scheduler: Any
    timesteps: torch.Tensor
    latents: torch.Tensor
    cond: Conditioning
    uncond: Conditioning | None
    guidance_scale: float
    generators: list[torch.Generator]
    step_kwargs: dict[str, Any] = field(default_factory=dict)
    steps_done: int = 0

    @property
    def total_steps(self) -> int:
        return len(self.timesteps)

    @property
    def is_done(self) -> bool:
        return self.steps_done >= self.total_steps

    @property
    def num_images(self) -> int:
        return self.latents.shape[0]

    @property
    def rows(self) -> int:
        """Rows this request adds to a denoiser forward."""
        return self.latents.shape[0] * (1 if self.uncond is None else 2)


def own_scheduler(template: Any, num_inference_steps: int, device: torch.device | str, **kwargs: Any) -> Any:
    """A copy of the pipeline's scheduler with this request's timesteps set (~0.2 ms)."""
    scheduler = copy.deepcopy(template)
    scheduler.set_timesteps(num_inference_steps, device=device, **kwargs)
    return scheduler


def step_together(states: list[DenoiseState], denoise: Denoiser) -> None:
    """Advance every state by one step with ONE denoiser forward.

    The forward runs before any state changes, so if it raises no request has moved and
    each can be retried alone.
    """
    inputs: list[torch.Tensor] = []
    times: list[torch.Tensor] = []
    conds: list[Conditioning] = []
    for state in states:
        t = state.timesteps[state.steps_done]
        x = state.latents
        if hasattr(state.scheduler, "scale_model_input"):
            x = state.scheduler.scale_model_input(x, t)
        for cond in (state.uncond, state.cond):
            if cond is None:
                continue
            inputs.append(x)
            conds.append(cond)
            times.append(t.reshape(1).to(torch.float32).expand(x.shape[0]))
    merged = {name: torch.cat([cond[name] for cond in conds]) for name in conds[0]}
    prediction = denoise(torch.cat(inputs), torch.cat(times), merged)
    guided = []
    offset = 0
    for state in states:
        n = state.latents.shape[0]
        if state.uncond is None:
            guided.append(prediction[offset : offset + n])
        else:
            without, with_text = prediction[offset : offset + n], prediction[offset + n : offset + 2 * n]
            guided.append(without + state.guidance_scale * (with_text - without))
        offset += state.rows
    for state, noise in zip(states, guided, strict=True):
        t = state.timesteps[state.steps_done]
        state.latents = state.scheduler.step(noise, t, state.latents, **state.step_kwargs, return_dict=False)[
            0
        ]
        state.steps_done += 1


def outputs_by_request(states: list[DenoiseState], arrays: list[Any]) -> list[RequestOutput]:
    """Give each finished request its own n images (rows in state order), with its seeds."""
    outputs, start = [], 0
    for state in states:
        params = state.request.params
        images = tuple(arrays[start : start + params.n])
        outputs.append(RequestOutput(state.request.request_id, images, tuple(params.image_seeds())))
        start += params.n
    return outputs
