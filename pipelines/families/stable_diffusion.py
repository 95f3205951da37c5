"""Stable Diffusion 1.x/2.x: text-to-image, image-to-image and inpainting, request-level
and step-level.

The stages follow `StableDiffusionPipeline.__call__` step by step — encode the prompt,
set the timesteps (on the request's own scheduler copy), draw the latents from the
request's generators scaled by that copy's `init_noise_sigma`, denoise, decode and run
the safety checker — so a request's image equals the stock pipeline's for it alone. An
inpainting checkpoint's 9-channel UNet reads the mask and the masked image's latents
beside the latents; a 4-channel one inpaints through `KeepOutsideMask`.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion_img2img import retrieve_latents
from diffusers.utils.torch_utils import randn_tensor
from torch import Tensor

from engine.request import GenerationRequest
from pipelines.controlnet import ControlNets
from pipelines.families.base import Family, TaskUse
from pipelines.ip_adapter import IPAdapters
from pipelines.outputs import resolved
from pipelines.stepping.setup import encode_together, own_scheduler
from pipelines.stepping.state import Conditioning, DenoiseState, Encoded
from pipelines.tasks.base import TEXT_TO_IMAGE, Task
from pipelines.tasks.image_to_image import IMAGE_TO_IMAGE
from pipelines.tasks.inpainting import INPAINTING, MASK, MASKED_IMAGE

_TEXT = "encoder_hidden_states"


class StableDiffusion(Family):
    uses: ClassVar[tuple[TaskUse, ...]] = (
        TaskUse(TEXT_TO_IMAGE, "StableDiffusionPipeline"),
        TaskUse(IMAGE_TO_IMAGE, "StableDiffusionImg2ImgPipeline"),
        TaskUse(INPAINTING, "StableDiffusionInpaintPipeline"),
    )
    key_name: ClassVar[str] = "sd"
    fixed_timesteps: ClassVar[bool] = True
    splits_cfg: ClassVar[bool] = True
    splits_cfg_with_controlnet: ClassVar[bool] = True  # each branch's rows, its own text
    controlnets: ControlNets | None

    def steps(self) -> bool:
        # Inpainting steps with a 4-channel UNet or an inpainting checkpoint's 9 channels.
        # LCM-distilled UNets step too: each row gets its request's guidance embedding.
        unet = self.pipe.unet.config
        return not self.use.task.accepts_mask or unet.in_channels in (4, 9)

    def uses_cfg(self, request: GenerationRequest) -> bool:
        # As in diffusers: guidance above 1, and not a guidance-distilled UNet (LCM).
        distilled = self.pipe.unet.config.time_cond_proj_dim is not None
        return resolved(request.params.guidance_scale) > 1 and not distilled

    def encode(self, requests: list[GenerationRequest], task: Task) -> list[Encoded]:
        """CLIP pads to a fixed length, so every joiner's rows come from one encoder call."""

        def encode(texts: list[str], _owners: list[GenerationRequest]) -> tuple[Tensor, ...]:
            embeds, _ = self.pipe.encode_prompt(texts, self.device, 1, False)
            return (embeds,)

        def conditioning(request: GenerationRequest, rows: tuple[Tensor, ...]) -> Conditioning:
            return {_TEXT: rows[0]}

        return encode_together(requests, self.uses_cfg, encode, conditioning)

    def scheduler(self, request: GenerationRequest) -> Any:
        if self.config.timesteps:  # a distilled model's (DMD2), as `retrieve_timesteps` sets them
            return own_scheduler(
                self.pipe.scheduler, None, self.device, timesteps=list(self.config.timesteps)
            )
        steps = resolved(request.params.num_inference_steps)
        return own_scheduler(self.pipe.scheduler, steps, self.device)

    def noise(
        self,
        request: GenerationRequest,
        scheduler: Any,
        generators: list[torch.Generator],
        cond: Conditioning,
    ) -> Tensor:
        pipe, params = self.pipe, request.params
        scale = pipe.vae_scale_factor
        shape = (
            params.n,
            pipe.unet.config.in_channels,
            resolved(params.height) // scale,
            resolved(params.width) // scale,
        )
        noise = randn_tensor(shape, generator=generators, device=self.device, dtype=cond[_TEXT].dtype)
        latents: Tensor = noise * scheduler.init_noise_sigma
        return latents

    def state(
        self,
        request: GenerationRequest,
        scheduler: Any,
        latents: Tensor,
        generators: list[torch.Generator],
        prompts: Encoded,
        *,
        first_step: int = 0,
    ) -> DenoiseState:
        """The request at its first step: SD's guidance and scheduler step arguments."""
        return DenoiseState.start(
            request,
            scheduler,
            latents,
            prompts=prompts,
            guidance_scale=resolved(request.params.guidance_scale),
            generators=generators,
            step_kwargs=self.pipe.prepare_extra_step_kwargs(generators, 0.0),
            first_step=first_step,
        )

    def denoise(self, states: list[Any], latents: Tensor, timesteps: Tensor, cond: Conditioning) -> Tensor:
        masked = {name: cond[name] for name in (MASK, MASKED_IMAGE) if name in cond}
        cond = {name: value for name, value in cond.items() if name not in masked}
        embedding_dim = self.pipe.unet.config.time_cond_proj_dim
        if embedding_dim is not None:
            cond = {**cond, "timestep_cond": self._guidance_embedding(states, embedding_dim, latents)}
        if self.controlnets is not None:
            # On the latents alone: diffusers' ControlNet inpainting pipeline adds the mask
            # channels for the UNet only.
            residuals = self.controlnets.residuals(states, latents, timesteps, self.control_inputs(cond))
            if residuals is not None:  # lists of tensors: the UNet takes them by keyword as the rest
                cond = {**cond, **residuals}
        if masked:
            # `latents` were scaled by each request's scheduler (`scale_model_input`); the
            # mask and the masked image's latents join them unscaled, as in diffusers.
            latents = torch.cat([latents, masked[MASK], masked[MASKED_IMAGE]], dim=1)
        if self.ip_adapters is not None:
            with self.ip_adapters.applied(states, latents.dtype):
                return self.unet(latents, timesteps, cond)
        return self.unet(latents, timesteps, cond)

    def control_inputs(self, cond: Conditioning) -> dict[str, Any]:
        """The ControlNet's arguments of a forward but latents, timesteps and image: those
        of the UNet (the text, an LCM's guidance embedding)."""
        return dict(cond)

    def takes_controlnet(self) -> bool:
        # diffusers' StableDiffusionControlNet{,Img2Img,Inpaint}Pipeline: every task, the
        # inpainting one with a 4- or 9-channel UNet (the ControlNet reads the 4 latent channels).
        return type(self) is StableDiffusion and self.steps()

    def load_controlnets(self, sources: tuple[tuple[str, str], ...]) -> ControlNets:
        return ControlNets.load(self.pipe, sources)

    def takes_ip_adapter(self) -> bool:
        # `ip_adapter_image` of every Stable Diffusion and SDXL pipeline served here: text-to-image,
        # image-to-image and inpainting (a 9-channel inpainting UNet's cross-attentions are
        # those of the 4-channel one). The image tokens enter the UNet's cross-attentions only,
        # so neither the latents a task draws nor SDXL's added text and size embeddings change.
        return self.steps()

    def load_ip_adapters(self, sources: tuple[tuple[str, str], ...]) -> IPAdapters:
        return IPAdapters.load(self.pipe, sources)

    def _guidance_embedding(self, states: list[Any], embedding_dim: int, latents: Tensor) -> Tensor:
        """An LCM-distilled UNet's guidance input, one row per image at its request's own scale
        (w = guidance - 1, as diffusers' pipelines embed it); such a UNet has no negative rows."""
        scales = torch.cat([torch.full((state.rows,), state.guidance_scale - 1.0) for state in states])
        embedding: Tensor = self.pipe.get_guidance_scale_embedding(scales, embedding_dim=embedding_dim)
        return embedding.to(device=latents.device, dtype=latents.dtype)

    def unet(self, latents: Tensor, timesteps: Tensor, cond: Conditioning) -> Tensor:
        out: Tensor = self.pipe.unet(latents, timesteps, **cond, return_dict=False)[0]
        return out

    def decode(self, states: list[Any], latents: Tensor) -> Any:
        """As the stock pipeline's tail: VAE, safety checker, postprocess."""
        pipe = self.pipe
        image = pipe.vae.decode(latents / pipe.vae.config.scaling_factor, return_dict=False)[0]
        image, nsfw = pipe.run_safety_checker(image, latents.device, latents.dtype)
        denormalize = [True] * image.shape[0] if nsfw is None else [not flagged for flagged in nsfw]
        return pipe.image_processor.postprocess(image, output_type="np", do_denormalize=denormalize)

    # Input images ---------------------------------------------------------------------------

    def encode_image(
        self,
        request: GenerationRequest,
        pixels: Tensor,
        generators: list[torch.Generator],
        dtype: torch.dtype,
    ) -> Tensor:
        """Through the inpainting pipeline's own `_encode_vae_image`; the img2img pipeline
        has none, and samples each row with its generator (`prepare_latents`)."""
        pipe = self.pipe
        pixels = pixels.to(self.device, dtype)
        if hasattr(pipe, "_encode_vae_image"):
            encoded: Tensor = pipe._encode_vae_image(pixels, generators)
            return encoded
        sampled = [
            retrieve_latents(pipe.vae.encode(pixels[i : i + 1]), generator=generator)
            for i, generator in enumerate(generators)
        ]
        image: Tensor = pipe.vae.config.scaling_factor * torch.cat(sampled)
        return image

    def noise_shape(self, request: GenerationRequest) -> tuple[int, ...]:
        pipe, params = self.pipe, request.params
        scale = pipe.vae_scale_factor
        return (
            params.n,
            pipe.vae.config.latent_channels,
            resolved(params.height) // scale,
            resolved(params.width) // scale,
        )

    def reads_mask(self) -> bool:
        return bool(self.pipe.unet.config.in_channels == 9)

    def mask_latents(
        self,
        request: GenerationRequest,
        condition: Tensor,
        pixels: Tensor,
        generators: list[torch.Generator],
        dtype: torch.dtype,
    ) -> tuple[Tensor, Tensor | None]:
        """The mask at latent size and the masked input's latents, sampled with the
        generators (even where the UNet reads only the mask's place: the draws are the
        pipeline's)."""
        params = request.params
        with self.vae_lock:
            mask, masked = self.pipe.prepare_mask_latents(
                condition,
                pixels * (condition < 0.5),
                params.n,
                resolved(params.height),
                resolved(params.width),
                dtype,
                self.device,
                generators,
                False,
            )
        return mask, masked
