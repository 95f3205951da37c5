"""Inpainting: a mask says what to repaint, the rest is kept. The families served with it,
each `edit_mixins.Inpainting` in front of its text-to-image family:

- `StableDiffusionInpaint`, `StableDiffusionXLInpaint`: inpainting checkpoints (a 9-channel
  UNet: latents, mask, masked-image latents), found by their model index's class
  (`StableDiffusionInpaintPipeline`, `StableDiffusionXLInpaintPipeline`), or text-to-image
  weights (a 4-channel UNet) through those pipelines, chosen with `pipeline_class`;
- `QwenImageInpaint`, `FluxInpaint`: Qwen-Image's and FLUX's text-to-image weights through
  `QwenImageInpaintPipeline` and `FluxInpaintPipeline` (`from_pipe`), chosen with
  `pipeline_class: pipelines.inpainting:<Class>`.

The server hands a mask over in diffusers' convention (HxW uint8, 255 = repaint), having
converted OpenAI's (fully transparent = edit) in one place (`server.uploads.edit_mask`).
Request-level: one image and mask go to diffusers per generated image, at strength 1.

Step-level, drawn as the diffusers pipeline draws them (the generators in the same order):
- a 9-channel UNet (SD, SDXL) gets the mask and the masked image's latents beside the
  latents (scaled by the scheduler) at every step, concatenated along the channels per row;
- FLUX, Qwen-Image and a 4-channel UNet start from noise and, after every step, get the input's
  latents (noised to the request's next timestep) back outside the mask.
So requests of any mask, input image, steps and guidance share a step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Self

import torch
import torch.nn.functional as F  # noqa: N812 - the usual torch spelling
from diffusers.utils.torch_utils import randn_tensor
from torch import Tensor

from engine.request import GenerationRequest
from pipelines.base import PipelineConfig
from pipelines.edit_mixins import Inpainting
from pipelines.flux import FluxTextToImage
from pipelines.image_to_image import noised_packed_input, through
from pipelines.outputs import resolved
from pipelines.qwen_image import QwenImageTextToImage
from pipelines.sdxl import StableDiffusionXLTextToImage
from pipelines.stable_diffusion import StableDiffusionTextToImage
from pipelines.stepping.setup import generators_for
from pipelines.stepping.state import Conditioning, DenoiseState, Encoded

_TEXT = "encoder_hidden_states"
# SD inpainting's extra UNet input channels, per row (in the conditioning of both CFG halves).
_MASK = "mask"
_MASKED_IMAGE = "masked_image_latents"


class StableDiffusionInpaint(Inpainting, StableDiffusionTextToImage):
    """An inpainting checkpoint (9-channel UNet: latents, mask, masked image's latents), or
    text-to-image weights (4 channels) through `StableDiffusionInpaintPipeline`, chosen with
    `pipeline_class`; both step-level."""

    @classmethod
    def load(cls, config: PipelineConfig) -> Self:
        from diffusers import StableDiffusionInpaintPipeline

        return cls(through(StableDiffusionInpaintPipeline, config), config)

    @property
    def supports_step_batch(self) -> bool:  # type: ignore[override]
        return bool(self.pipe.unet.config.in_channels in (4, 9)) and super().supports_step_batch

    def _prepare(
        self, request: GenerationRequest, cond: Conditioning, uncond: Conditioning | None
    ) -> DenoiseState:
        """As the inpainting pipeline at strength 1, drawing from the request's generators in
        its order: a 4-channel UNet's input latents (to put back outside the mask), noise,
        then the masked input's latents (one row per image, as request mode sends one image
        per generated image), and the mask at latent size. A 9-channel UNet reads the mask
        and the masked image's latents at every step; a 4-channel one gets the input back
        outside the mask after each step (`KeepOutsideMask`)."""
        pipe, params = self.pipe, request.params
        n, height, width = params.n, resolved(params.height), resolved(params.width)
        generators = generators_for(request)
        scheduler = self._own_scheduler(request)
        device, dtype = self.device, cond[_TEXT].dtype
        pixels = self._input_pixels(request)
        image = None  # a 4-channel UNet's input latents, put back outside the mask
        if pipe.unet.config.in_channels == 4:
            with self.vae_lock:  # a decode may be running beside
                image = pipe._encode_vae_image(pixels.to(device, dtype), generators)
        scale = pipe.vae_scale_factor
        shape = (n, pipe.vae.config.latent_channels, height // scale, width // scale)
        noise = randn_tensor(shape, generator=generators, device=device, dtype=dtype)
        condition = self._mask_condition(request)
        with self.vae_lock:
            mask, masked_latents = pipe.prepare_mask_latents(
                condition, pixels * (condition < 0.5), n, height, width, dtype, device, generators, False
            )
        latents = noise * scheduler.init_noise_sigma
        state = self._state(request, scheduler, latents, generators, (cond, uncond))
        if image is not None:
            state.after_step = KeepOutsideMask(image, noise, mask, flow_matching=False)
        else:
            for conditioning in (cond, uncond):
                if conditioning is not None:
                    conditioning.update({_MASK: mask, _MASKED_IMAGE: masked_latents})
        return state

    def _denoise(self, states: list[Any], latents: Tensor, timesteps: Tensor, cond: Conditioning) -> Tensor:
        if _MASK not in cond:  # a 4-channel UNet
            return super()._denoise(states, latents, timesteps, cond)
        # `latents` were scaled by each request's scheduler (`scale_model_input`); the mask and
        # the masked image's latents join them unscaled, as in diffusers.
        hidden = torch.cat([latents, cond[_MASK], cond[_MASKED_IMAGE]], dim=1)
        text = {name: value for name, value in cond.items() if name not in (_MASK, _MASKED_IMAGE)}
        return super()._denoise(states, hidden, timesteps, text)


class StableDiffusionXLInpaint(StableDiffusionInpaint, StableDiffusionXLTextToImage):
    """SDXL inpainting: a 9-channel checkpoint (its model index names
    `StableDiffusionXLInpaintPipeline`), or SDXL's text-to-image weights through that
    pipeline, chosen with `pipeline_class`. Stages: SD's inpainting over SDXL's."""

    aesthetic_time_ids: ClassVar[bool] = True

    @classmethod
    def load(cls, config: PipelineConfig) -> Self:
        from diffusers import StableDiffusionXLInpaintPipeline

        return cls(through(StableDiffusionXLInpaintPipeline, config), config)


class QwenImageInpaint(Inpainting, QwenImageTextToImage):
    @classmethod
    def load(cls, config: PipelineConfig) -> Self:
        from diffusers import QwenImageInpaintPipeline

        return cls(through(QwenImageInpaintPipeline, config), config)

    def _prepare(self, request: GenerationRequest, cond: Conditioning, uncond: Conditioning | None) -> Any:
        return noise_kept_outside_mask(self, request, (cond, uncond))


class FluxInpaint(Inpainting, FluxTextToImage):
    """FLUX.1's text-to-image weights through `FluxInpaintPipeline`, chosen with
    `pipeline_class` (FLUX Fill, a checkpoint whose transformer reads the mask, is not
    served)."""

    @classmethod
    def load(cls, config: PipelineConfig) -> Self:
        from diffusers import FluxInpaintPipeline

        return cls(through(FluxInpaintPipeline, config), config)

    def _linear_sigmas(self) -> bool:
        return True  # FluxInpaintPipeline sets sigmas 1 → 1/steps whatever the scheduler's config

    def _prepare(self, request: GenerationRequest, cond: Conditioning, uncond: Conditioning | None) -> Any:
        return noise_kept_outside_mask(self, request, (cond, uncond))


def noise_kept_outside_mask(
    family: QwenImageInpaint | FluxInpaint, request: GenerationRequest, prompts: Encoded
) -> DenoiseState:
    """As the FLUX and Qwen-Image inpainting pipelines at strength 1: the input's latents and
    noise (pure noise at the first sigma, 1), and after each step the input back outside the
    mask. (The pipelines also encode the masked image, which their transformers never read.)"""
    generators = generators_for(request)
    scheduler = family._own_scheduler(request)
    dtype = prompts[0][_TEXT].dtype
    latents, image, noise = noised_packed_input(
        family, request, scheduler, first=0, generators=generators, dtype=dtype
    )
    state = family._state(request, scheduler, latents, generators, prompts)
    state.after_step = KeepOutsideMask(image, noise, packed_mask(family, request, dtype))
    return state


def packed_mask(
    family: QwenImageInpaint | FluxInpaint, request: GenerationRequest, dtype: torch.dtype
) -> Tensor:
    """The mask at latent size, packed as the latents are (1 = repaint), one row per image,
    as the FLUX and Qwen-Image inpainting pipelines' `prepare_mask_latents`."""
    pipe, params = family.pipe, request.params
    side = pipe.vae_scale_factor * 2
    height, width = 2 * (resolved(params.height) // side), 2 * (resolved(params.width) // side)
    channels = pipe.transformer.config.in_channels // 4
    mask = F.interpolate(family._mask_condition(request), size=(height, width))
    mask = mask.to(family.device, dtype).repeat(1, channels, 1, 1)
    packed: Tensor = pipe._pack_latents(mask, params.n, channels, height, width)
    return packed


@dataclass(frozen=True, eq=False)
class KeepOutsideMask:
    """An inpainting request's `after_step` where the denoiser does not read the mask
    (Qwen-Image, a 4-channel UNet): outside the mask its latents become the input's, noised
    to the request's next timestep (the input itself after the last step), as the diffusers
    inpainting pipelines do after each scheduler step. Tensors as the latents are, n rows;
    the mask 1 where repainted."""

    image: Tensor
    noise: Tensor
    mask: Tensor
    # Noised as a flow-matching scheduler does (`scale_noise`), else `add_noise`.
    flow_matching: bool = True

    def __call__(self, state: DenoiseState) -> None:
        kept = self.image
        if not state.is_done:
            # After a step the scheduler's own index points at that timestep.
            upcoming = state.timesteps[state.steps_done].reshape(1)
            if self.flow_matching:
                kept = state.scheduler.scale_noise(kept, upcoming, self.noise)
            else:
                kept = state.scheduler.add_noise(kept, self.noise, upcoming)
        state.latents = (1 - self.mask) * kept + self.mask * state.latents
