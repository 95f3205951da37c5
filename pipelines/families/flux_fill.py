"""FLUX.1 Fill: inpainting with a checkpoint whose transformer reads the mask
(`FluxFillPipeline`), request-level and step-level.

FLUX.1-dev's network (`pipelines.families.flux`) with a wider input: each packed token carries
the noisy latents, the masked image's latents and the mask folded from pixels into channels
(one per pixel of a VAE cell, times the 2x2 packing), concatenated on the channel axis at
every step (`Inpainting` puts the mask and the masked image's latents into each row's
conditioning, as for Stable Diffusion's 9-channel UNet). Guidance is the distilled
embedding at 30 by default; the call takes no negative prompt and has no true CFG.

The generators are drawn as the pipeline draws them at strength 1: the input's latents
(sampled, though at sigma 1 the start is the noise alone), the noise, then the masked
image's latents (`samples_input_latents`).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from engine.request import GenerationRequest, InvalidRequestError, SamplingParams
from pipelines.families.base import TaskUse
from pipelines.families.flux import Flux
from pipelines.families.policies import CLASSIFIER_FREE, Guidance
from pipelines.outputs import resolved
from pipelines.stepping.state import Conditioning
from pipelines.tasks.inpainting import INPAINTING, MASK, MASKED_IMAGE


class FluxFill(Flux):
    """FLUX.1 Fill: guidance 30 and 50 steps (the call's defaults)."""

    uses: ClassVar[tuple[TaskUse, ...]] = (TaskUse(INPAINTING, "FluxFillPipeline", name="FluxFill"),)
    mixes_sizes: ClassVar[bool] = False
    mixes_sizes_why: ClassVar[str] = "its mask channels ride beside each row's own tokens, unpadded"
    key_name: ClassVar[str] = "flux-fill"
    default_steps: ClassVar[int] = 50
    default_guidance_scale: ClassVar[float | None] = 30.0
    default_true_cfg_scale: ClassVar[float | None] = None
    guidance: ClassVar[Guidance] = CLASSIFIER_FREE
    samples_input_latents: ClassVar[bool] = True
    no_cfg: ClassVar[str | None] = "FLUX.1 Fill is guidance-distilled (one row per image)"

    def validate(self, params: SamplingParams) -> None:
        if params.negative_prompt:
            raise InvalidRequestError("negative_prompt is not supported by FLUX.1 Fill", "negative_prompt")

    def uses_cfg(self, request: GenerationRequest) -> bool:
        return False  # guidance-distilled: one row per image

    def latent_channels(self) -> int:
        # The transformer's input is wider than the latents: the VAE says.
        return int(self.pipe.vae.config.latent_channels)

    def reads_mask(self) -> bool:
        return True

    def mask_latents(
        self,
        request: GenerationRequest,
        condition: Tensor,
        pixels: Tensor,
        generators: list[torch.Generator],
        dtype: torch.dtype,
    ) -> tuple[Tensor, Tensor | None]:
        """The folded, packed mask and the masked image's packed latents (sampled with the
        generators), as the call's `prepare_mask_latents`."""
        pipe, params = self.pipe, request.params
        masked = (pixels * (1 - condition)).to(self.device, dtype)
        with self.vae_lock:  # a decode may be running beside
            mask, masked_latents = pipe.prepare_mask_latents(
                condition,
                masked,
                params.n,
                self.latent_channels(),
                1,
                resolved(params.height),
                resolved(params.width),
                dtype,
                self.device,
                generators,
            )
        return mask, masked_latents

    def denoiser_input(self, hidden: Tensor, cond: Conditioning) -> Tensor:
        return torch.cat([hidden, cond[MASKED_IMAGE], cond[MASK]], dim=2)
