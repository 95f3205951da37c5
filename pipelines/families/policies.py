"""Small rules a family picks rather than inherits: how it guides and how it sizes images.

A family names its rules as class attributes (`guidance = TRUE_CFG`, `sizes = PATCHIFIED`),
so every family stays one flat subclass of `pipelines.families.base.Family`, with no
intermediate classes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.request import SamplingParams


def _given(value: float | None) -> float:
    if value is None:
        raise RuntimeError("sampling parameters were not resolved before use")
    return value


@dataclass(frozen=True, slots=True)
class Guidance:
    """How a family guides.

    `negative_prompt_in_key`: a missing negative prompt computes something else than an
    empty one (SDXL zeroes the negative embedding; FLUX and Qwen-Image switch true CFG
    off), so requests with and without one cannot share a request-level call.
    `true_cfg`: guidance runs a negative branch only with `true_cfg_scale > 1` and a
    negative prompt, as in diffusers' FLUX and Qwen-Image; otherwise with a guidance scale
    above 1 (Stable Diffusion's classifier-free guidance).
    """

    negative_prompt_in_key: bool = False
    true_cfg: bool = False

    def uses_cfg(self, params: SamplingParams) -> bool:
        """Whether a request has negative rows (an empty negative prompt is none)."""
        if self.true_cfg:
            return _given(params.true_cfg_scale) > 1 and bool(params.negative_prompt)
        return _given(params.guidance_scale) > 1

    def call_kwargs(self, params: SamplingParams) -> dict[str, Any]:
        """The guidance arguments of the diffusers call for a batch of one key."""
        if not self.true_cfg:
            return {"guidance_scale": params.guidance_scale}
        # Without a negative prompt (the whole batch: it is in the key) true CFG is off
        # whatever the scale; passing 1 says so and keeps diffusers from warning on every call.
        true_cfg = params.true_cfg_scale if params.negative_prompt else 1.0
        return {"guidance_scale": params.guidance_scale, "true_cfg_scale": true_cfg}


CLASSIFIER_FREE = Guidance()
# SDXL: classifier-free, but no negative prompt means zero negative embeddings.
CLASSIFIER_FREE_ZEROED = Guidance(negative_prompt_in_key=True)
TRUE_CFG = Guidance(negative_prompt_in_key=True, true_cfg=True)


@dataclass(frozen=True, slots=True)
class Sizes:
    """A family's default image size and the multiple sizes must be, from its pipeline."""

    default: Callable[[Any], tuple[int, int]]
    multiple: Callable[[Any], int]


def _unet_default(pipe: Any) -> tuple[int, int]:
    side = int(pipe.unet.config.sample_size) * int(pipe.vae_scale_factor)
    return side, side


def _patchified_default(pipe: Any) -> tuple[int, int]:
    side = int(pipe.default_sample_size) * int(pipe.vae_scale_factor)
    return side, side


def _patchified_multiple(pipe: Any) -> int:
    # Latents are packed into patches (2x2 unless the pipeline says otherwise); other
    # sizes are silently resized or refused by diffusers.
    return int(pipe.vae_scale_factor) * int(getattr(pipe, "patch_size", 2))


# The UNet pipelines' check_inputs demand multiples of 8.
UNET = Sizes(default=_unet_default, multiple=lambda pipe: 8)
# Transformers over patchified latents (SD3, FLUX, Qwen-Image).
PATCHIFIED = Sizes(default=_patchified_default, multiple=_patchified_multiple)


def video_sizes(default: tuple[int, int], multiple: int) -> Sizes:
    """A video family's: its diffusers `__call__` default (these pipelines derive none from
    their config) and the multiple its `check_inputs` demands (not derived from the VAE)."""
    return Sizes(default=lambda pipe: default, multiple=lambda pipe: multiple)
