"""Image-to-image: `strength` says how much of the input image is redrawn. The families
served with it, each `edit_mixins.ImageToImage` in front of its text-to-image family, the
text-to-image weights called through diffusers' img2img pipeline (`from_pipe`), chosen
with `pipeline_class: pipelines.image_to_image:<Class>`: `StableDiffusionImageToImage`,
`StableDiffusionXLImageToImage`, `FluxImageToImage`, `QwenImageImageToImage`. Inpainting
is in `pipelines/inpainting.py`.

Request-level: one input image goes to diffusers per generated image, so requests batch
by the usual key plus `strength` (diffusers takes one per call).

Step-level: each family steps with its text-to-image stages and starts from other latents,
drawn as its diffusers pipeline draws them (the generators in the same order, so a
request's image is the one the stock pipeline makes for it alone): its own schedule begins
part-way (`get_timesteps`: strength 0.6 of 10 steps takes the last 6) from the input's VAE
latents, sampled with the request's generators and noised to that first timestep. So
requests of any strength, input image, steps and guidance share a step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Self

import torch
from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion_img2img import retrieve_latents
from diffusers.utils.torch_utils import randn_tensor
from torch import Tensor

from engine.request import GenerationRequest, SamplingParams
from pipelines.base import PipelineConfig
from pipelines.edit_mixins import ImageToImage
from pipelines.flux import FluxTextToImage
from pipelines.loading import load_diffusers
from pipelines.outputs import resolved
from pipelines.qwen_image import QwenImageTextToImage
from pipelines.sdxl import StableDiffusionXLTextToImage
from pipelines.stable_diffusion import StableDiffusionTextToImage
from pipelines.stepping.setup import flow_skipped_steps, generators_for
from pipelines.stepping.state import Conditioning, DenoiseState

if TYPE_CHECKING:
    from pipelines.inpainting import FluxInpaint, QwenImageInpaint

_TEXT = "encoder_hidden_states"


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
        return flow_skipped_steps(steps, strength)

    def _prepare(self, request: GenerationRequest, cond: Conditioning, uncond: Conditioning | None) -> Any:
        generators = generators_for(request)
        scheduler = self._own_scheduler(request)
        first = self._start_at_strength(request, scheduler)
        dtype = cond[_TEXT].dtype
        latents, _, _ = noised_packed_input(
            self, request, scheduler, first=first, generators=generators, dtype=dtype
        )
        return self._state(request, scheduler, latents, generators, (cond, uncond), first_step=first)


class StableDiffusionXLImageToImage(ImageToImage, StableDiffusionXLTextToImage):
    """SDXL's text-to-image weights through `StableDiffusionXLImg2ImgPipeline` (a refiner
    checkpoint, whose model index names that class, is served by it too)."""

    aesthetic_time_ids: ClassVar[bool] = True

    @classmethod
    def load(cls, config: PipelineConfig) -> Self:
        from diffusers import StableDiffusionXLImg2ImgPipeline

        return cls(through(StableDiffusionXLImg2ImgPipeline, config), config)

    def size_kwargs(self, params: SamplingParams) -> dict[str, Any]:
        return {}  # as SD's: the input image, sent at the output size, sets it

    def _prepare(
        self, request: GenerationRequest, cond: Conditioning, uncond: Conditioning | None
    ) -> DenoiseState:
        """As `StableDiffusionXLImg2ImgPipeline.prepare_latents`: the input's VAE latents
        (upcast where the VAE needs it, normalised by its latents mean and std if it has
        them) sampled with each generator, then noise from the same generators, added at
        the first timestep of the request's own schedule."""
        n = request.params.n
        generators = generators_for(request)
        scheduler = self._own_scheduler(request)
        first = self._start_at_strength(request, scheduler)
        device, dtype = self.device, cond[_TEXT].dtype
        with self.vae_lock:  # a decode may be running beside
            image = self.pipe.prepare_latents(
                self._input_pixels(request), None, n, 1, dtype, device, generators, add_noise=False
            )
        noise = randn_tensor(image.shape, generator=generators, device=device, dtype=dtype)
        latents = scheduler.add_noise(image, noise, scheduler.timesteps[first : first + 1].repeat(n))
        return self._state(request, scheduler, latents, generators, (cond, uncond), first_step=first)


class FluxImageToImage(ImageToImage, FluxTextToImage):
    @classmethod
    def load(cls, config: PipelineConfig) -> Self:
        from diffusers import FluxImg2ImgPipeline

        return cls(through(FluxImg2ImgPipeline, config), config)

    def skipped_steps(self, steps: int, strength: float) -> int:
        return flow_skipped_steps(steps, strength)

    def _linear_sigmas(self) -> bool:
        return True  # FluxImg2ImgPipeline sets sigmas 1 → 1/steps whatever the scheduler's config

    def _prepare(self, request: GenerationRequest, cond: Conditioning, uncond: Conditioning | None) -> Any:
        generators = generators_for(request)
        scheduler = self._own_scheduler(request)
        first = self._start_at_strength(request, scheduler)
        latents, _, _ = noised_packed_input(
            self, request, scheduler, first=first, generators=generators, dtype=cond[_TEXT].dtype
        )
        return self._state(request, scheduler, latents, generators, (cond, uncond), first_step=first)


def through(diffusers_class: Any, config: PipelineConfig) -> Any:
    """The configured text-to-image weights in another diffusers pipeline class (`from_pipe`
    shares them), its progress bars off as `load_diffusers` leaves the first one's."""
    pipe = diffusers_class.from_pipe(load_diffusers(config))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def noised_packed_input(
    family: FluxImageToImage | QwenImageImageToImage | FluxInpaint | QwenImageInpaint,
    request: GenerationRequest,
    scheduler: Any,
    *,
    first: int,
    generators: list[torch.Generator],
    dtype: torch.dtype,
) -> tuple[Tensor, Tensor, Tensor]:
    """The packed (latents, input's latents, noise) of a FLUX or Qwen-Image img2img or
    inpainting request, as those pipelines' `prepare_latents`: the input's VAE latents
    (FLUX's shifted and scaled, Qwen-Image's normalised, by the pipeline's own
    `_encode_vae_image`) sampled with each generator, noise from the same generators, and
    the two mixed at the request's first timestep (`scale_noise`). Qwen-Image's VAE is a
    video VAE: the input goes in, and the latents come out, as one frame."""
    pipe, params = family.pipe, request.params
    n, side = params.n, pipe.vae_scale_factor * 2
    height, width = 2 * (resolved(params.height) // side), 2 * (resolved(params.width) // side)
    channels = pipe.transformer.config.in_channels // 4
    device = family.device
    one_frame = isinstance(family, QwenImageTextToImage)
    pixels = family._input_pixels(request).to(device, dtype)
    with family.vae_lock:  # VAEs keep per-call caches; a decode may run beside
        if one_frame:
            image = pipe._encode_vae_image(pixels.unsqueeze(2), generators).transpose(1, 2)
        else:
            image = pipe._encode_vae_image(pixels, generators)
    shape = (n, 1, channels, height, width) if one_frame else (n, channels, height, width)
    noise = randn_tensor(shape, generator=generators, device=device, dtype=dtype)
    latents = scheduler.scale_noise(image, scheduler.timesteps[first : first + 1].repeat(n), noise)
    return (
        pipe._pack_latents(latents, n, channels, height, width),
        pipe._pack_latents(image, n, channels, height, width),
        pipe._pack_latents(noise, n, channels, height, width),
    )


def __getattr__(name: str) -> Any:
    # Inpainting lived here before pipelines/inpainting.py: configs that name it here
    # (`pipeline_class: pipelines.image_to_image:QwenImageInpaint`) still load.
    if name in ("QwenImageInpaint", "StableDiffusionInpaint"):
        from pipelines import inpainting

        return getattr(inpainting, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
