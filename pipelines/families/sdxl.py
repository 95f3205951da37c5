"""SDXL: Stable Diffusion's stages with SDXL's two text encoders, pooled embedding and
size/crop conditioning, and its VAE tail; text-to-image, image-to-image (the refiner's
pipeline too) and inpainting.

As `StableDiffusionXLPipeline.__call__`: a request without a negative prompt gets zero
negative embeddings (`force_zeros_for_empty_prompt`, SDXL's default), its size is its
original and target size, crops start at (0, 0).
"""

from __future__ import annotations

import inspect
from typing import Any, ClassVar

import torch
from torch import Tensor

from engine.request import GenerationRequest
from pipelines.controlnet import RESIDUAL_ARGUMENTS
from pipelines.families.base import TaskUse
from pipelines.families.policies import CLASSIFIER_FREE_ZEROED, Guidance
from pipelines.families.stable_diffusion import StableDiffusion
from pipelines.outputs import resolved
from pipelines.stepping.state import Conditioning, Encoded
from pipelines.tasks.base import TEXT_TO_IMAGE, Task
from pipelines.tasks.image_to_image import IMAGE_TO_IMAGE
from pipelines.tasks.inpainting import INPAINTING


class StableDiffusionXL(StableDiffusion):
    uses: ClassVar[tuple[TaskUse, ...]] = (
        TaskUse(TEXT_TO_IMAGE, "StableDiffusionXLPipeline"),
        TaskUse(IMAGE_TO_IMAGE, "StableDiffusionXLImg2ImgPipeline"),  # and SDXL's refiner
        TaskUse(INPAINTING, "StableDiffusionXLInpaintPipeline"),
    )
    default_guidance_scale: ClassVar[float | None] = 5.0
    # With force_zeros_for_empty_prompt (SDXL's default) no negative prompt means a zero
    # negative embedding, which an empty string would not reproduce.
    guidance: ClassVar[Guidance] = CLASSIFIER_FREE_ZEROED

    def encode(self, requests: list[GenerationRequest], task: Task) -> list[Encoded]:
        """All joiners' prompts and the negatives that need encoding, in one call per encoder."""
        pipe = self.pipe
        zero_empty = bool(pipe.config.force_zeros_for_empty_prompt)
        guided = [r for r in requests if self.uses_cfg(r)]
        encoded_negatives = [r for r in guided if r.params.negative_prompt or not zero_empty]
        texts = [r.prompt for r in requests for _ in range(r.params.n)]
        texts += [r.params.negative_prompt or "" for r in encoded_negatives for _ in range(r.params.n)]
        embeds, _, pooled, _ = pipe.encode_prompt(
            texts, device=self.device, num_images_per_prompt=1, do_classifier_free_guidance=False
        )
        sizes = [r.params.n for r in [*requests, *encoded_negatives]]
        rows = iter(zip(embeds.split(sizes), pooled.split(sizes), strict=True))
        positive = [self._conditioning(r, *next(rows)) for r in requests]
        negative_ids = {r.request_id for r in encoded_negatives}
        guided_ids = {r.request_id for r in guided}
        result: list[Encoded] = []
        for request, cond in zip(requests, positive, strict=True):
            uncond = None
            if request.request_id in negative_ids:
                uncond = self._conditioning(request, *next(rows), negative=True)
            elif request.request_id in guided_ids:
                zeros = {name: torch.zeros_like(value) for name, value in cond.items() if name != "time_ids"}
                uncond = {**zeros, "time_ids": self._time_ids(request, cond["text_embeds"], negative=True)}
            result.append((cond, uncond))
        return result

    def _conditioning(
        self, request: GenerationRequest, embeds: Tensor, pooled: Tensor, *, negative: bool = False
    ) -> Conditioning:
        return {
            "encoder_hidden_states": embeds,
            "text_embeds": pooled,
            "time_ids": self._time_ids(request, pooled, negative=negative),
        }

    def _time_ids(self, request: GenerationRequest, pooled: Tensor, *, negative: bool) -> Tensor:
        """The size/crop conditioning, one row per image: the request's size as original and
        target size, crops at (0, 0). The img2img and inpainting pipelines' own take
        aesthetic scores: a refiner (`requires_aesthetics_score`) conditions on diffusers'
        default aesthetic scores instead of the target size, 6 for the prompt's rows and
        2.5 for the negative's."""
        pipe, params = self.pipe, request.params
        size = (resolved(params.height), resolved(params.width))
        projection = self._projection_dim(pooled)
        if "aesthetic_score" in inspect.signature(pipe._get_add_time_ids).parameters:
            positive, negative_ids = pipe._get_add_time_ids(
                size, (0, 0), size, 6.0, 2.5, size, (0, 0), size,
                dtype=pooled.dtype, text_encoder_projection_dim=projection,
            )  # fmt: skip
            time_ids: Tensor = negative_ids if negative else positive
        else:
            time_ids = pipe._get_add_time_ids(
                size, (0, 0), size, dtype=pooled.dtype, text_encoder_projection_dim=projection
            )
        return time_ids.to(pooled.device).repeat(params.n, 1)

    def _projection_dim(self, pooled: Tensor) -> int:
        encoder = self.pipe.text_encoder_2
        return int(pooled.shape[-1]) if encoder is None else int(encoder.config.projection_dim)

    def unet(self, latents: Tensor, timesteps: Tensor, cond: Conditioning) -> Tensor:
        added = {"text_embeds": cond["text_embeds"], "time_ids": cond["time_ids"]}
        residuals = {name: cond[name] for name in RESIDUAL_ARGUMENTS if name in cond}
        out: Tensor = self.pipe.unet(
            latents,
            timesteps,
            encoder_hidden_states=cond["encoder_hidden_states"],
            added_cond_kwargs=added,
            return_dict=False,
            **residuals,
        )[0]
        return out

    def control_inputs(self, cond: Conditioning) -> dict[str, Any]:
        # As StableDiffusionXLControlNetPipeline: the text, pooled text and size numbers.
        added = {"text_embeds": cond["text_embeds"], "time_ids": cond["time_ids"]}
        return {"encoder_hidden_states": cond["encoder_hidden_states"], "added_cond_kwargs": added}

    def takes_controlnet(self) -> bool:
        # diffusers' StableDiffusionXLControlNet{,Img2Img,Inpaint}Pipeline: every task, the
        # inpainting one with a 4- or 9-channel UNet (the ControlNet reads the 4 latent
        # channels). Their denoising loops are the plain pipelines' with the ControlNet's
        # residuals added: same noise, encodes, size numbers and (for a refiner) aesthetic scores.
        return type(self) is StableDiffusionXL and self.steps()

    def decode(self, states: list[Any], latents: Tensor) -> Any:
        pipe = self.pipe
        vae = pipe.vae
        upcast = vae.dtype == torch.float16 and vae.config.force_upcast  # float16 overflows there
        if upcast:
            pipe.upcast_vae()
            latents = latents.to(next(iter(vae.post_quant_conv.parameters())).dtype)
        mean, std = getattr(vae.config, "latents_mean", None), getattr(vae.config, "latents_std", None)
        if mean is not None and std is not None:
            mean = torch.tensor(mean).view(1, 4, 1, 1).to(latents.device, latents.dtype)
            std = torch.tensor(std).view(1, 4, 1, 1).to(latents.device, latents.dtype)
            latents = latents * std / vae.config.scaling_factor + mean
        else:
            latents = latents / vae.config.scaling_factor
        image = vae.decode(latents, return_dict=False)[0]
        if upcast:
            vae.to(dtype=torch.float16)
        if pipe.watermark is not None:
            image = pipe.watermark.apply_watermark(image)
        return pipe.image_processor.postprocess(image, output_type="np")

    def encode_image(
        self,
        request: GenerationRequest,
        pixels: Tensor,
        generators: list[torch.Generator],
        dtype: torch.dtype,
    ) -> Tensor:
        """Through the inpainting pipeline's `_encode_vae_image`; through the img2img
        pipeline's `prepare_latents` without noise (upcast where the VAE needs it,
        normalised by its latents mean and std if it has them)."""
        pipe = self.pipe
        if hasattr(pipe, "_encode_vae_image"):
            encoded: Tensor = pipe._encode_vae_image(pixels.to(self.device, dtype), generators)
            return encoded
        n = request.params.n
        image: Tensor = pipe.prepare_latents(
            pixels, None, n, 1, dtype, self.device, generators, add_noise=False
        )
        return image
