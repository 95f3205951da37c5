"""Image-edit adapters (Qwen-Image-Edit): text-to-image plus the request's input image.

QwenImageEditPipeline resizes the condition image to about 1024x1024 pixels keeping its
aspect ratio, and in a batched call it sizes every condition image from the first one. So
requests share a forward only when their input images give the same condition size (it
is in the batch key); their output size defaults to that size, as in diffusers.

Step-level, following `QwenImageEditPipeline.__call__`: Qwen2.5-VL reads each prompt with
its own input image (resized to the condition size), the VAE encodes that image once per
request into packed "image latents", and every step runs the transformer on the noisy
latents followed by the image latents (the condition's tokens come second in `img_shapes`)
and keeps the prediction for the noisy part only. The condition size sets the sequence
length, so it is in the step key; steps, guidance and negative prompts are per request.

Qwen-Image-Edit-Plus (several input images per request) refuses batches: it runs one
request per forward, request-level (its conditions differ in number and size per request).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, ClassVar, Self

import numpy as np
import torch
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions
from PIL import Image
from torch import Tensor

from engine.request import BatchKey, GenerationRequest, RequestBatch, RequestOutput, SamplingParams
from pipelines.base import Modality, PipelineConfig
from pipelines.loading import load_diffusers
from pipelines.outputs import resolved
from pipelines.qwen_edit_loading import load_qwen_image_edit
from pipelines.qwen_image import QwenImageTextToImage
from pipelines.stepping.state import Conditioning

# The area QwenImageEditPipeline resizes its condition image to.
_CONDITION_AREA = 1024 * 1024


def condition_size(image: np.ndarray) -> tuple[int, int]:
    """(width, height) the pipeline gives the condition image made from `image`."""
    height, width = image.shape[:2]
    calculated_width, calculated_height, _ = calculate_dimensions(_CONDITION_AREA, width / height)
    return int(calculated_width), int(calculated_height)


_IMAGE_LATENTS = "image_latents"


class QwenImageEdit(QwenImageTextToImage):
    modality: ClassVar[Modality] = "edit"
    input_image_count: ClassVar[tuple[int, int]] = (1, 1)

    @classmethod
    def load(cls, config: PipelineConfig) -> Self:
        return cls(load_diffusers(config, load_qwen_image_edit), config)

    def model_default_size(self) -> tuple[int, int]:
        # Only used when a request has no input image, which admission refuses; an edit's
        # default size comes from its input image (see `resolve`).
        return 1024, 1024

    def resolve(self, request: GenerationRequest) -> SamplingParams:
        params = request.params
        if (
            request.input_images
            and params.width is None
            and params.height is None
            and not self.config.default_size
        ):
            width, height = condition_size(request.input_images[0])
            params = replace(params, width=width, height=height)
        return super().resolve(replace(request, params=params))

    def batch_key(self, request: GenerationRequest) -> BatchKey:
        condition = condition_size(request.input_images[0]) if request.input_images else None
        return (*super().batch_key(request), condition)

    def input_kwargs(self, batch: RequestBatch) -> dict[str, Any]:
        # One input image per generated image, in the order prompts were expanded, already at
        # the condition size: given a list, diffusers would show Qwen2.5-VL the images as sent,
        # where the stock call with one image shows it the resized one.
        images = [
            self._condition_image(request) for request in batch.requests for _ in range(request.params.n)
        ]
        return {"image": images}

    # Step-level stages: Qwen-Image's, with the input image in the text encoder and in the
    # transformer's sequence ------------------------------------------------------------

    def step_key(self, request: GenerationRequest) -> BatchKey:
        return (*super().step_key(request), condition_size(request.input_images[0]))

    def step_cost(self, request: GenerationRequest) -> int:
        # Each row carries the condition image's tokens after its own (the budget's default
        # request has no image: its condition is taken to be its output size).
        params = request.params
        if not request.input_images:
            return 2 * super().step_cost(request)
        width, height = condition_size(request.input_images[0])
        output = resolved(params.width) * resolved(params.height)
        return super().step_cost(request) * (output + width * height) // output

    def _condition_image(self, request: GenerationRequest) -> Image.Image:
        """The input image at the condition size, as the pipeline resizes it."""
        width, height = condition_size(request.input_images[0])
        resized: Image.Image = self.pipe.image_processor.resize(
            Image.fromarray(request.input_images[0]), height, width
        )
        return resized

    def _prompt_inputs(self, owners: list[GenerationRequest]) -> dict[str, Any]:
        # Qwen2.5-VL reads each prompt with its request's image at the condition size.
        return {"image": [self._condition_image(request) for request in owners]}

    def _initial_latents(
        self,
        request: GenerationRequest,
        generators: list[torch.Generator],
        cond: Conditioning,
        uncond: Conditioning | None,
    ) -> Tensor:
        """The noise, and the input image's packed VAE latents into both conditionings (the
        VAE takes its mode, so the generators only draw the noise, as in diffusers)."""
        pipe, params = self.pipe, request.params
        width, height = condition_size(request.input_images[0])
        image = pipe.image_processor.preprocess(self._condition_image(request), height, width).unsqueeze(2)
        with self.vae_lock:  # the VAE encodes the image; a decode may be running beside
            latents, image_latents = pipe.prepare_latents(
                image,
                params.n,
                pipe.transformer.config.in_channels // 4,
                resolved(params.height),
                resolved(params.width),
                cond["encoder_hidden_states"].dtype,
                self.device,
                generators,
            )
        for conditioning in (cond, uncond):
            if conditioning is not None:
                conditioning[_IMAGE_LATENTS] = image_latents
        result: Tensor = latents
        return result

    def _denoise(self, states: list[Any], latents: Tensor, timesteps: Tensor, cond: Conditioning) -> Tensor:
        tokens = latents.shape[1]
        sequence = torch.cat([latents, cond[_IMAGE_LATENTS]], dim=1)
        return super()._denoise(states, sequence, timesteps, cond)[:, :tokens]

    def _image_shapes(self, request: GenerationRequest) -> list[tuple[int, int, int]]:
        width, height = condition_size(request.input_images[0])
        side = self.pipe.vae_scale_factor * 2
        return [*super()._image_shapes(request), (1, height // side, width // side)]


class QwenImageEditPlus(QwenImageEdit):
    """Several input images per request (1 to 3); diffusers refuses batches of prompts."""

    supports_request_batch: ClassVar[bool] = False
    # Its conditions differ in number and size per request: request-level only.
    supports_step_batch: ClassVar[bool] = False
    input_image_count: ClassVar[tuple[int, int]] = (1, 3)

    def forward(self, batch: RequestBatch) -> list[RequestOutput]:
        # One request per batch (no request batching), and one image per call: n=2 is two calls.
        (request,) = batch.requests
        images: list[Any] = []
        for seed in request.params.image_seeds():
            single = replace(request, params=replace(request.params, n=1, seed=seed))
            images.extend(super().forward(RequestBatch(key=batch.key, requests=(single,)))[0].images)
        return [RequestOutput(request.request_id, tuple(images), tuple(request.params.image_seeds()))]

    def input_kwargs(self, batch: RequestBatch) -> dict[str, Any]:
        (request,) = batch.requests
        return {"image": [Image.fromarray(image) for image in request.input_images]}
