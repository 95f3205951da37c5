"""Edits that start from the input image: inpainting (a mask says what to repaint, the rest
is kept) and image-to-image (`strength` says how much of the whole image is redrawn): the
families served with them, each a mixin of `pipelines/edit_mixins.py` in front of its
text-to-image family.

- `StableDiffusionInpaint`: inpainting checkpoints (`StableDiffusionInpaintPipeline`, a
  9-channel UNet: latents, mask, masked-image latents), found by their class name.
- `StableDiffusionImageToImage`, `QwenImageInpaint`, `QwenImageImageToImage`: the
  text-to-image weights called through diffusers' img2img / inpaint pipelines
  (`from_pipe`), chosen with `pipeline_class: pipelines.image_to_image:<Class>`.

The server hands a mask over in diffusers' convention (HxW uint8, 255 = repaint), having
converted OpenAI's (fully transparent = edit) in one place (`server.uploads.edit_mask`).

Request-level: one image (and mask) goes to diffusers per generated image, so requests
batch by the usual key, plus `strength` for image-to-image.

Step-level: each family steps with its text-to-image stages and starts from other latents,
drawn as its diffusers pipeline draws them (the generators in the same order, so a
request's image is the one the stock pipeline makes for it alone):
- image-to-image begins its own schedule part-way (`get_timesteps`: strength 0.6 of 10
  steps takes the last 6) from the input's VAE latents, sampled with the request's
  generators and noised to that first timestep;
- SD inpainting gives the UNet the mask and the masked image's latents beside the latents
  (scaled by the scheduler) at every step, concatenated along the channels per row;
- Qwen-Image inpainting starts from noise and, after every step, puts the input's latents
  (noised to the request's next timestep) back outside the mask.
So requests of any strength, mask, input image, steps and guidance share a step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Self

import torch
import torch.nn.functional as F  # noqa: N812 - the usual torch spelling
from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion_img2img import retrieve_latents
from diffusers.utils.torch_utils import randn_tensor
from torch import Tensor

from engine.request import GenerationRequest, SamplingParams
from pipelines.base import PipelineConfig
from pipelines.edit_mixins import ImageToImage, Inpainting
from pipelines.loading import load_diffusers
from pipelines.qwen_image import QwenImageTextToImage
from pipelines.request_setup import Conditioning, generators_for
from pipelines.stable_diffusion import StableDiffusionTextToImage
from pipelines.stepping import DenoiseState
from pipelines.text_to_image import resolved

_TEXT = "encoder_hidden_states"
# SD inpainting's extra UNet input channels, per row (in the conditioning of both CFG halves).
_MASK = "mask"
_MASKED_IMAGE = "masked_image_latents"


class StableDiffusionImageToImage(ImageToImage, StableDiffusionTextToImage):
    @classmethod
    def load(cls, config: PipelineConfig) -> Self:
        from diffusers import StableDiffusionImg2ImgPipeline

        return cls(through(StableDiffusionImg2ImgPipeline, config), config)

    def size_kwargs(self, params: SamplingParams) -> dict[str, Any]:
        return {}  # SD's img2img takes its size from the image, sent at the output size

    def _prepare(
        self, request: GenerationRequest, cond: Conditioning, uncond: Conditioning | None
    ) -> DenoiseState:
        """As `StableDiffusionImg2ImgPipeline.prepare_latents`: the input's VAE latents sampled
        with each generator, then noise from the same generators, added at the first timestep
        of the request's own schedule."""
        pipe, n = self.pipe, request.params.n
        generators = generators_for(request)
        scheduler = self._own_scheduler(request)
        first = self._start_at_strength(request, scheduler)
        device, dtype = self.device, cond[_TEXT].dtype
        pixels = self._input_pixels(request).to(device, dtype)
        with self.vae_lock:  # a decode may be running beside
            sampled = [
                retrieve_latents(pipe.vae.encode(pixels[i : i + 1]), generator=generator)
                for i, generator in enumerate(generators)
            ]
        image = pipe.vae.config.scaling_factor * torch.cat(sampled)
        noise = randn_tensor(image.shape, generator=generators, device=device, dtype=dtype)
        latents = scheduler.add_noise(image, noise, scheduler.timesteps[first : first + 1].repeat(n))
        return self._state(request, scheduler, latents, generators, (cond, uncond), first_step=first)


class QwenImageImageToImage(ImageToImage, QwenImageTextToImage):
    @classmethod
    def load(cls, config: PipelineConfig) -> Self:
        from diffusers import QwenImageImg2ImgPipeline

        return cls(through(QwenImageImg2ImgPipeline, config), config)

    def skipped_steps(self, steps: int, strength: float) -> int:
        # QwenImageImg2ImgPipeline.get_timesteps rounds the skipped steps down instead.
        return int(max(steps - min(steps * strength, steps), 0))

    def _prepare(self, request: GenerationRequest, cond: Conditioning, uncond: Conditioning | None) -> Any:
        generators = generators_for(request)
        scheduler = self._own_scheduler(request)
        first = self._start_at_strength(request, scheduler)
        dtype = cond[_TEXT].dtype
        latents, _, _ = noised_qwen_input(
            self, request, scheduler, first=first, generators=generators, dtype=dtype
        )
        return self._state(request, scheduler, latents, generators, (cond, uncond), first_step=first)


class StableDiffusionInpaint(Inpainting, StableDiffusionTextToImage):
    @property
    def supports_step_batch(self) -> bool:  # type: ignore[override]
        # A 4-channel UNet through the inpainting pipeline blends latents and mask after each
        # step instead, which these stages do not do: such a checkpoint is served request-level.
        return bool(self.pipe.unet.config.in_channels == 9) and super().supports_step_batch

    def _prepare(
        self, request: GenerationRequest, cond: Conditioning, uncond: Conditioning | None
    ) -> DenoiseState:
        """As `StableDiffusionInpaintPipeline` at strength 1: noise from the request's
        generators, then the masked input's VAE latents sampled with them (one row per image,
        as request mode sends one image per generated image), and the mask at latent size."""
        pipe, params = self.pipe, request.params
        n, height, width = params.n, resolved(params.height), resolved(params.width)
        generators = generators_for(request)
        scheduler = self._own_scheduler(request)
        device, dtype = self.device, cond[_TEXT].dtype
        scale = pipe.vae_scale_factor
        shape = (n, pipe.vae.config.latent_channels, height // scale, width // scale)
        noise = randn_tensor(shape, generator=generators, device=device, dtype=dtype)
        condition = self._mask_condition(request)
        masked = self._input_pixels(request) * (condition < 0.5)
        with self.vae_lock:  # a decode may be running beside
            mask, masked_latents = pipe.prepare_mask_latents(
                condition, masked, n, height, width, dtype, device, generators, False
            )
        for conditioning in (cond, uncond):
            if conditioning is not None:
                conditioning.update({_MASK: mask, _MASKED_IMAGE: masked_latents})
        latents = noise * scheduler.init_noise_sigma
        return self._state(request, scheduler, latents, generators, (cond, uncond))

    def _denoise(self, states: list[Any], latents: Tensor, timesteps: Tensor, cond: Conditioning) -> Tensor:
        # `latents` were scaled by each request's scheduler (`scale_model_input`); the mask and
        # the masked image's latents join them unscaled, as in diffusers.
        hidden = torch.cat([latents, cond[_MASK], cond[_MASKED_IMAGE]], dim=1)
        text = {name: value for name, value in cond.items() if name not in (_MASK, _MASKED_IMAGE)}
        return super()._denoise(states, hidden, timesteps, text)


class QwenImageInpaint(Inpainting, QwenImageTextToImage):
    @classmethod
    def load(cls, config: PipelineConfig) -> Self:
        from diffusers import QwenImageInpaintPipeline

        return cls(through(QwenImageInpaintPipeline, config), config)

    def _prepare(self, request: GenerationRequest, cond: Conditioning, uncond: Conditioning | None) -> Any:
        """As `QwenImageInpaintPipeline` at strength 1: the input's latents and noise (pure
        noise at the first sigma, 1), and after each step the input back outside the mask.
        (The pipeline also encodes the masked image, which its transformer never reads.)"""
        generators = generators_for(request)
        scheduler = self._own_scheduler(request)
        dtype = cond[_TEXT].dtype
        latents, image, noise = noised_qwen_input(
            self, request, scheduler, first=0, generators=generators, dtype=dtype
        )
        state = self._state(request, scheduler, latents, generators, (cond, uncond))
        state.after_step = KeepOutsideMask(image, noise, self._packed_mask(request, dtype))
        return state

    def _packed_mask(self, request: GenerationRequest, dtype: torch.dtype) -> Tensor:
        """The mask at latent size, packed as the latents are (1 = repaint), one row per image:
        `QwenImageInpaintPipeline.prepare_mask_latents`."""
        pipe, params = self.pipe, request.params
        side = pipe.vae_scale_factor * 2
        height, width = 2 * (resolved(params.height) // side), 2 * (resolved(params.width) // side)
        channels = pipe.transformer.config.in_channels // 4
        mask = F.interpolate(self._mask_condition(request), size=(height, width))
        mask = mask.to(self.device, dtype).repeat(1, channels, 1, 1)
        packed: Tensor = pipe._pack_latents(mask, params.n, channels, height, width)
        return packed


@dataclass(frozen=True, eq=False)
class KeepOutsideMask:
    """A Qwen-Image inpainting request's `after_step`: outside the mask its latents become the
    input's, noised to the request's next timestep (the input itself after the last step),
    as `QwenImageInpaintPipeline` does after each scheduler step. Tensors packed, n rows."""

    image: Tensor
    noise: Tensor
    mask: Tensor

    def __call__(self, state: DenoiseState) -> None:
        kept = self.image
        if not state.is_done:
            upcoming = state.timesteps[state.steps_done].reshape(1)
            # After a step the scheduler's own index points at that timestep.
            kept = state.scheduler.scale_noise(kept, upcoming, self.noise)
        state.latents = (1 - self.mask) * kept + self.mask * state.latents


def through(diffusers_class: Any, config: PipelineConfig) -> Any:
    """The configured text-to-image weights in another diffusers pipeline class (`from_pipe`
    shares them), its progress bars off as `load_diffusers` leaves the first one's."""
    pipe = diffusers_class.from_pipe(load_diffusers(config))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def noised_qwen_input(
    family: QwenImageImageToImage | QwenImageInpaint,
    request: GenerationRequest,
    scheduler: Any,
    *,
    first: int,
    generators: list[torch.Generator],
    dtype: torch.dtype,
) -> tuple[Tensor, Tensor, Tensor]:
    """The packed (latents, input's latents, noise) of a Qwen-Image img2img or inpainting
    request, as those pipelines' `prepare_latents`: the input's normalised VAE latents
    sampled with each generator, noise from the same generators, and the two mixed at the
    request's first timestep (`scale_noise`)."""
    pipe, params = family.pipe, request.params
    n, side = params.n, pipe.vae_scale_factor * 2
    height, width = 2 * (resolved(params.height) // side), 2 * (resolved(params.width) // side)
    channels = pipe.transformer.config.in_channels // 4
    device = family.device
    pixels = family._input_pixels(request).unsqueeze(2).to(device, dtype)
    with family.vae_lock:  # the VAE keeps a per-call feature cache; a decode may run beside
        image = pipe._encode_vae_image(pixels, generators).transpose(1, 2)
    noise = randn_tensor((n, 1, channels, height, width), generator=generators, device=device, dtype=dtype)
    latents = scheduler.scale_noise(image, scheduler.timesteps[first : first + 1].repeat(n), noise)
    return (
        pipe._pack_latents(latents, n, channels, height, width),
        pipe._pack_latents(image, n, channels, height, width),
        pipe._pack_latents(noise, n, channels, height, width),
    )
