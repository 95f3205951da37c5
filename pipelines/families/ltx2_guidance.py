"""LTX-2's step-level pieces besides the family: where a request's video and audio latents
sit in its one latent row, and its guidance, applied in x0 space per modality as
`LTX2Pipeline.__call__` applies it (diffusers 0.42.1).

One row holds both latents, packed and flattened, video first. A request's video and audio
schedulers are the same (the stock call deep-copies one into the other and sets both with
the same sigmas and `mu`), and `FlowMatchEulerDiscreteScheduler.step` is elementwise
(`sample + dt * velocity` with the step's one `dt`), so one scheduler stepping the joined row
gives each modality exactly what its own scheduler gives it. That keeps the shared stepping
machinery (one latent tensor and one scheduler per state, the trial-step-then-commit of
`step_together`) as it is. The family checks the scheduler is that elementwise one before
it steps (`LTX2.steps`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from diffusers.pipelines.ltx2.pipeline_ltx2 import rescale_noise_cfg
from torch import Tensor

from pipelines.stepping.state import DenoiseState


@dataclass(frozen=True, slots=True)
class Layout:
    """One step group's latent sizes (its step key fixes them): the video's latent grid
    (before the transformer's patches) and its packed tokens and width, the audio's latent
    frames, packed width and latent mel bins."""

    frames: int
    height: int
    width: int
    video_tokens: int
    video_channels: int
    audio_frames: int
    audio_channels: int
    mel_bins: int

    def split(self, joint: Tensor) -> tuple[Tensor, Tensor]:
        """Rows of joined latents (or predictions) as the packed video (B, tokens, C) and
        audio (B, frames, C_a x mel bins) the transformer takes (views of them)."""
        boundary = self.video_tokens * self.video_channels
        video = joint[:, :boundary].reshape(-1, self.video_tokens, self.video_channels)
        audio = joint[:, boundary:].reshape(-1, self.audio_frames, self.audio_channels)
        return video, audio

    @staticmethod
    def join(video: Tensor, audio: Tensor) -> Tensor:
        return torch.cat([video.flatten(1), audio.flatten(1)], dim=1)


@dataclass(frozen=True, slots=True)
class Scales:
    """One modality's guidance, as the stock call takes it: classifier-free (`cfg`),
    spatio-temporal (`stg`, a pass with blocks perturbed), modality isolation (`modality`,
    a pass without audio-video cross-attention), and the std rescale of the result."""

    cfg: float
    stg: float
    modality: float
    rescale: float


@dataclass(eq=False)
class LTX2State(DenoiseState):
    """A request of LTX-2: its video and audio guidance (`guidance_scale` is the video's
    classifier-free scale)."""

    video: Scales = Scales(1.0, 0.0, 1.0, 0.0)
    audio: Scales = Scales(1.0, 0.0, 1.0, 0.0)

    @property
    def perturbs(self) -> bool:
        return perturbs(self.video, self.audio)

    @property
    def isolates(self) -> bool:
        return isolates(self.video, self.audio)


def perturbs(video: Scales, audio: Scales) -> bool:
    """Whether a request's steps run the spatio-temporal guidance pass (either modality's scale)."""
    return video.stg > 0 or audio.stg > 0


def isolates(video: Scales, audio: Scales) -> bool:
    """Whether a request's steps run the modality isolation pass."""
    return video.modality > 1 or audio.modality > 1


@dataclass(frozen=True, slots=True)
class Predictions:
    """One modality's velocity predictions for a request's n rows: with its prompt, without
    (None without CFG), from the perturbed pass and from the isolated pass (None where the
    request runs no such pass)."""

    cond: Tensor
    uncond: Tensor | None
    perturbed: Tensor | None
    isolated: Tensor | None


def guided_velocity(
    pipe: Any, state: DenoiseState, sample: Tensor, pred: Predictions, scales: Scales
) -> Tensor:
    """The velocity the request's scheduler steps with, for one modality: every prediction
    to x0 with the request's own sigma, the guidance deltas added to the conditional x0,
    rescaled, and back to a velocity — in the stock loop's order, with its own conversions."""
    index, scheduler = state.first_step + state.steps_done, state.scheduler

    def x0(velocity: Tensor) -> Tensor:
        converted: Tensor = pipe.convert_velocity_to_x0(sample, velocity, index, scheduler)
        return converted

    cond = x0(pred.cond)
    cfg: Tensor | float = 0
    stg: Tensor | float = 0
    modality: Tensor | float = 0
    if pred.uncond is not None:
        cfg = (scales.cfg - 1) * (cond - x0(pred.uncond))
    if pred.perturbed is not None:
        stg = scales.stg * (cond - x0(pred.perturbed))
    if pred.isolated is not None:
        modality = (scales.modality - 1) * (cond - x0(pred.isolated))
    guided = cond + cfg + stg + modality
    if scales.rescale > 0:
        guided = rescale_noise_cfg(guided, cond, guidance_rescale=scales.rescale)
    velocity: Tensor = pipe.convert_x0_to_velocity(sample, guided, index, scheduler)
    return velocity


def guided_row(pipe: Any, layout: Layout, state: LTX2State, passes: list[Tensor | None]) -> Tensor:
    """The request's guided velocity (joined), from its (conditional, unconditional,
    perturbed, isolated) predictions (joined; None for a pass it does not run)."""
    split = [(None, None) if p is None else layout.split(p) for p in passes]
    samples = layout.split(state.latents)
    velocities = []
    for modality, scales in enumerate((state.video, state.audio)):
        cond, uncond, perturbed, isolated = (parts[modality] for parts in split)
        assert cond is not None
        predictions = Predictions(cond, uncond, perturbed, isolated)
        velocities.append(guided_velocity(pipe, state, samples[modality], predictions, scales))
    return Layout.join(*velocities)
