"""Edits that start from the input image: inpainting (a mask says what to repaint, the rest
is kept) and image-to-image (`strength` says how much of the whole image is redrawn), as
mixins over the text-to-image families, and the families served with them.

- `StableDiffusionInpaint`: inpainting checkpoints (`StableDiffusionInpaintPipeline`, a
  9-channel UNet: latents, mask, masked-image latents), found by their class name.
- `StableDiffusionImageToImage`, `QwenImageInpaint`, `QwenImageImageToImage`: the
  text-to-image weights called through diffusers' img2img / inpaint pipelines
  (`from_pipe`), chosen with `pipeline_class: pipelines.image_to_image:<Class>`.

The server hands a mask over in diffusers' convention (HxW uint8, 255 = repaint), having
converted OpenAI's (fully transparent = edit) in one place (`server.uploads.edit_mask`).
One image (and mask) goes to diffusers per generated image, so requests batch by the usual
key, plus `strength` for image-to-image (it decides where each image's schedule starts).
The output size defaults to the input's. An inpainting output keeps the input's own
pixels wherever the mask says keep: the VAE cannot reproduce a picture exactly, and only
the masked area should be new. Request-level batching only (not stepped families yet).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, ClassVar, Self

import numpy as np
from PIL import Image

from engine.request import BatchKey, GenerationRequest, RequestBatch, RequestOutput, SamplingParams
from pipelines.base import Modality, PipelineConfig
from pipelines.loading import load_diffusers
from pipelines.qwen_image import QwenImageTextToImage
from pipelines.text_to_image import DiffusersTextToImage, resolved

# diffusers' default for its img2img pipelines.
DEFAULT_STRENGTH = 0.8


class InputImageEdit(DiffusersTextToImage):
    """One input image, which also gives the output its default size."""

    modality: ClassVar[Modality] = "edit"
    input_image_count: ClassVar[tuple[int, int]] = (1, 1)
    supports_step_batch: ClassVar[bool] = False

    def resolve(self, request: GenerationRequest) -> SamplingParams:
        params = request.params
        if request.input_images and params.width is None and params.height is None:
            # The input's own size (not --default-size: a repainted photo keeps its size),
            # down to the model's size multiple.
            height, width = request.input_images[0].shape[:2]
            step = self.size_multiple
            width, height = max(step, width // step * step), max(step, height // step * step)
            params = replace(params, width=width, height=height)
        return super().resolve(replace(request, params=params))

    def _input_at_size(self, request: GenerationRequest) -> np.ndarray:
        width, height = resolved(request.params.width), resolved(request.params.height)
        source = Image.fromarray(request.input_images[0])
        return np.asarray(source.resize((width, height), Image.Resampling.LANCZOS))


class Inpainting(InputImageEdit):
    accepts_mask: ClassVar[bool] = True

    def input_kwargs(self, batch: RequestBatch) -> dict[str, Any]:
        images, masks = [], []
        for request in batch.requests:
            image, mask = self._inputs_at_size(request)
            for _ in range(request.params.n):
                images.append(Image.fromarray(image))
                masks.append(Image.fromarray(mask))
        # Strength 1: the masked area is drawn anew, not from the input's noised pixels.
        return {**super().input_kwargs(batch), "image": images, "mask_image": masks, "strength": 1.0}

    def forward(self, batch: RequestBatch) -> list[RequestOutput]:
        outputs = super().forward(batch)
        if batch.requests[0].params.output_type == "latent":
            return outputs
        return [self._keep_unmasked(r, output) for r, output in zip(batch.requests, outputs, strict=True)]

    def _inputs_at_size(self, request: GenerationRequest) -> tuple[np.ndarray, np.ndarray]:
        """The input image and its mask at the output size (a request without a mask
        repaints everything, as an edit without a mask does at OpenAI)."""
        width, height = resolved(request.params.width), resolved(request.params.height)
        image = self._input_at_size(request)
        if request.mask is None:
            return image, np.full((height, width), 255, np.uint8)
        mask = np.asarray(Image.fromarray(request.mask).resize((width, height), Image.Resampling.NEAREST))
        return image, mask

    def _keep_unmasked(self, request: GenerationRequest, output: RequestOutput) -> RequestOutput:
        image, mask = self._inputs_at_size(request)
        keep = mask[..., None] < 128
        return replace(output, images=tuple(np.where(keep, image, generated) for generated in output.images))


class ImageToImage(InputImageEdit):
    accepts_strength: ClassVar[bool] = True

    def resolve(self, request: GenerationRequest) -> SamplingParams:
        params = super().resolve(request)
        return params if params.strength is not None else replace(params, strength=DEFAULT_STRENGTH)

    def batch_key(self, request: GenerationRequest) -> BatchKey:
        return (*super().batch_key(request), request.params.strength)

    def family_kwargs(self, params: SamplingParams) -> dict[str, Any]:
        return {**super().family_kwargs(params), "strength": params.strength}

    def input_kwargs(self, batch: RequestBatch) -> dict[str, Any]:
        images = [
            Image.fromarray(self._input_at_size(request))
            for request in batch.requests
            for _ in range(request.params.n)
        ]
        return {**super().input_kwargs(batch), "image": images}


class StableDiffusionInpaint(Inpainting):
    pass


class StableDiffusionImageToImage(ImageToImage):
    @classmethod
    def load(cls, config: PipelineConfig) -> Self:
        from diffusers import StableDiffusionImg2ImgPipeline

        return cls(StableDiffusionImg2ImgPipeline.from_pipe(load_diffusers(config)), config)

    def size_kwargs(self, params: SamplingParams) -> dict[str, Any]:
        return {}  # SD's img2img takes its size from the image, sent at the output size


class QwenImageInpaint(Inpainting, QwenImageTextToImage):
    @classmethod
    def load(cls, config: PipelineConfig) -> Self:
        from diffusers import QwenImageInpaintPipeline

        return cls(QwenImageInpaintPipeline.from_pipe(load_diffusers(config)), config)


class QwenImageImageToImage(ImageToImage, QwenImageTextToImage):
    @classmethod
    def load(cls, config: PipelineConfig) -> Self:
        from diffusers import QwenImageImg2ImgPipeline

        return cls(QwenImageImg2ImgPipeline.from_pipe(load_diffusers(config)), config)
