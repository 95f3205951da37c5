"""Inpainting and image-to-image as mixins over a text-to-image family: what every family
does with an input image, a mask or a `strength` (the families are in
`pipelines/image_to_image.py`).

The output size defaults to the input's. An inpainting output keeps the input's own pixels
wherever the mask says keep — in request mode, in step mode and in previews: the VAE cannot
reproduce a picture exactly, and only the masked area should be new. Image-to-image puts
`strength` in the request-level batch key (diffusers takes one per call); step-level it
only decides where a request's own schedule starts (`ImageToImage._start_at_strength`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, ClassVar

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from engine.request import (
    BatchKey,
    GenerationRequest,
    InvalidRequestError,
    RequestBatch,
    RequestOutput,
    SamplingParams,
)
from pipelines.base import Modality
from pipelines.outputs import resolved
from pipelines.text_to_image import DiffusersTextToImage

# diffusers' default for its img2img pipelines.
DEFAULT_STRENGTH = 0.8


class InputImageEdit(DiffusersTextToImage):
    """One input image, which also gives the output its default size."""

    modality: ClassVar[Modality] = "edit"
    input_image_count: ClassVar[tuple[int, int]] = (1, 1)

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

    def _input_pixels(self, request: GenerationRequest) -> Tensor:
        """The input at the output size as diffusers hands it to the VAE, one row per image
        (n, 3, H, W), float32 in [-1, 1]: request mode's PIL images through the pipeline's own
        processor, memory layout included (a VAE's group norms over a flat area amplify the
        rounding that another layout gives)."""
        params = request.params
        image = Image.fromarray(self._input_at_size(request))
        processor = self.pipe.image_processor
        pixels: Tensor = processor.preprocess([image] * params.n, height=params.height, width=params.width)
        return pixels.to(torch.float32)


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

    def finish(self, states: list[Any]) -> list[RequestOutput]:
        outputs = super().finish(states)
        if states[0].request.params.output_type == "latent":
            return outputs
        return [self._keep_unmasked(s.request, output) for s, output in zip(states, outputs, strict=True)]

    def preview(self, states: list[Any]) -> list[tuple[Any, ...]]:
        # A preview shows the input outside the mask too, as the final image will.
        previews = super().preview(states)
        return [self._kept(state.request, images) for state, images in zip(states, previews, strict=True)]

    def _inputs_at_size(self, request: GenerationRequest) -> tuple[np.ndarray, np.ndarray]:
        """The input image and its mask at the output size (a request without a mask
        repaints everything, as an edit without a mask does at OpenAI)."""
        width, height = resolved(request.params.width), resolved(request.params.height)
        image = self._input_at_size(request)
        if request.mask is None:
            return image, np.full((height, width), 255, np.uint8)
        mask = np.asarray(Image.fromarray(request.mask).resize((width, height), Image.Resampling.NEAREST))
        return image, mask

    def _mask_condition(self, request: GenerationRequest) -> Tensor:
        """The mask at the output size as diffusers preprocesses it, one row per image
        (n, 1, H, W), 1 = repaint."""
        params = request.params
        mask = Image.fromarray(self._inputs_at_size(request)[1])
        processor = self.pipe.mask_processor
        condition: Tensor = processor.preprocess([mask] * params.n, height=params.height, width=params.width)
        return condition

    def _keep_unmasked(self, request: GenerationRequest, output: RequestOutput) -> RequestOutput:
        return replace(output, images=self._kept(request, output.images))

    def _kept(self, request: GenerationRequest, images: tuple[Any, ...]) -> tuple[Any, ...]:
        image, mask = self._inputs_at_size(request)
        keep = mask[..., None] < 128
        return tuple(np.where(keep, image, generated) for generated in images)


class ImageToImage(InputImageEdit):
    accepts_strength: ClassVar[bool] = True

    def resolve(self, request: GenerationRequest) -> SamplingParams:
        params = super().resolve(request)
        return params if params.strength is not None else replace(params, strength=DEFAULT_STRENGTH)

    def validate(self, params: SamplingParams) -> None:
        super().validate(params)
        steps, strength = resolved(params.num_inference_steps), resolved(params.strength)
        if self.skipped_steps(steps, strength) >= steps:
            raise InvalidRequestError(
                f"strength {strength} leaves none of the {steps} steps to take: raise strength "
                "or num_inference_steps",
                "strength",
            )

    def batch_key(self, request: GenerationRequest) -> BatchKey:
        # diffusers takes one strength per call; step-level, strength only decides where a
        # request's own schedule starts, so it is not in the step key.
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

    def skipped_steps(self, steps: int, strength: float) -> int:
        """How many of its steps a request skips, as the family's diffusers `get_timesteps`
        counts them (Stable Diffusion's: the redrawn steps rounded down)."""
        return max(steps - min(int(steps * strength), steps), 0)

    def _start_at_strength(self, request: GenerationRequest, scheduler: Any) -> int:
        """Set the request's own scheduler to begin where its strength says; the index of its
        first timestep (`get_timesteps`)."""
        params = request.params
        skipped = self.skipped_steps(resolved(params.num_inference_steps), resolved(params.strength))
        first = skipped * int(scheduler.order)
        if hasattr(scheduler, "set_begin_index"):
            scheduler.set_begin_index(first)
        return first
