"""Stable Diffusion edits: inpainting (`StableDiffusionInpaintPipeline`), which repaints the
area a mask marks and keeps the rest, and image-to-image (`StableDiffusionImg2ImgPipeline`,
`strength`), which redraws the whole input. Both take one input image, sized by default
as the input is (down to the model's size multiple).

Inpainting:
The server hands the mask over in diffusers' convention (HxW uint8, 255 = repaint), having
converted OpenAI's (fully transparent = edit) in one place (`server.uploads.edit_mask`).
Requests batch by the usual key (size, steps, guidance, ...): diffusers takes one image
and one mask per prompt. The VAE cannot reproduce a picture exactly, so the output keeps
the input's own pixels wherever the mask says keep, and only the masked area is new.
Request-level batching only: the 9-channel UNet (latents, mask, masked-image latents) is
not one of the stepped families yet.

Image-to-image: served from any Stable Diffusion checkpoint with
`pipeline_class: pipelines.sd_edits:StableDiffusionImageToImage` (the text-to-image
weights, called through diffusers' img2img pipeline). `strength` (default 0.8, diffusers')
is in the batch key: requests of two strengths run as two batches.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, ClassVar, Self

import numpy as np
from PIL import Image

from engine.request import BatchKey, GenerationRequest, RequestBatch, RequestOutput, SamplingParams
from pipelines.base import Modality, PipelineConfig
from pipelines.loading import load_diffusers
from pipelines.text_to_image import DiffusersTextToImage, resolved


class _StableDiffusionEdit(DiffusersTextToImage):
    modality: ClassVar[Modality] = "edit"
    input_image_count: ClassVar[tuple[int, int]] = (1, 1)

    def resolve(self, request: GenerationRequest) -> SamplingParams:
        params = request.params
        if request.input_images and params.width is None and params.height is None:
            # The input's own size (not --default-size: a repainted photo keeps its size),
            # down to the model's size multiple.
            height, width = request.input_images[0].shape[:2]
            step = self.size_multiple
            params = replace(
                params, width=max(step, width // step * step), height=max(step, height // step * step)
            )
        return super().resolve(replace(request, params=params))

    def _input_at_size(self, request: GenerationRequest) -> np.ndarray:
        width, height = resolved(request.params.width), resolved(request.params.height)
        source = Image.fromarray(request.input_images[0])
        return np.asarray(source.resize((width, height), Image.Resampling.LANCZOS))


class StableDiffusionInpaint(_StableDiffusionEdit):
    accepts_mask: ClassVar[bool] = True

    def input_kwargs(self, batch: RequestBatch) -> dict[str, Any]:
        images, masks = [], []
        for request in batch.requests:
            image, mask = self._inputs_at_size(request)
            for _ in range(request.params.n):
                images.append(Image.fromarray(image))
                masks.append(Image.fromarray(mask))
        return {"image": images, "mask_image": masks}

    def forward(self, batch: RequestBatch) -> list[RequestOutput]:
        outputs = super().forward(batch)
        if batch.requests[0].params.output_type == "latent":
            return outputs
        return [
            self._keep_unmasked(request, output)
            for request, output in zip(batch.requests, outputs, strict=True)
        ]

    def _inputs_at_size(self, request: GenerationRequest) -> tuple[np.ndarray, np.ndarray]:
        """The input image and its mask at the output size (a request without a mask
        repaints everything, as an edit without a mask does at OpenAI)."""
        width, height = resolved(request.params.width), resolved(request.params.height)
        image = np.asarray(
            Image.fromarray(request.input_images[0]).resize((width, height), Image.Resampling.LANCZOS)
        )
        if request.mask is None:
            return image, np.full((height, width), 255, np.uint8)
        mask = np.asarray(Image.fromarray(request.mask).resize((width, height), Image.Resampling.NEAREST))
        return image, mask

    def _keep_unmasked(self, request: GenerationRequest, output: RequestOutput) -> RequestOutput:
        image, mask = self._inputs_at_size(request)
        keep = mask[..., None] < 128
        return replace(output, images=tuple(np.where(keep, image, generated) for generated in output.images))


# diffusers' default for StableDiffusionImg2ImgPipeline.
DEFAULT_STRENGTH = 0.8


class StableDiffusionImageToImage(_StableDiffusionEdit):
    accepts_strength: ClassVar[bool] = True

    @classmethod
    def load(cls, config: PipelineConfig) -> Self:
        from diffusers import StableDiffusionImg2ImgPipeline

        return cls(StableDiffusionImg2ImgPipeline.from_pipe(load_diffusers(config)), config)

    def resolve(self, request: GenerationRequest) -> SamplingParams:
        params = super().resolve(request)
        return params if params.strength is not None else replace(params, strength=DEFAULT_STRENGTH)

    def batch_key(self, request: GenerationRequest) -> BatchKey:
        # One strength per diffusers call: it decides where each image's schedule starts.
        return (*super().batch_key(request), request.params.strength)

    def size_kwargs(self, params: SamplingParams) -> dict[str, Any]:
        return {}

    def family_kwargs(self, params: SamplingParams) -> dict[str, Any]:
        return {"strength": params.strength}

    def input_kwargs(self, batch: RequestBatch) -> dict[str, Any]:
        return {
            "image": [
                Image.fromarray(self._input_at_size(request))
                for request in batch.requests
                for _ in range(request.params.n)
            ]
        }
