"""Image-edit adapters (Qwen-Image-Edit): text-to-image plus the request's input image.

QwenImageEditPipeline resizes the condition image to about 1024x1024 pixels keeping its
aspect ratio, and in a batched call it sizes every condition image from the first one. So
requests share a forward only when their input images give the same condition size (it
is in the batch key); their output size defaults to that size, as in diffusers.
Qwen-Image-Edit-Plus (several input images per request) refuses batches: it runs one
request per forward.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, ClassVar, Self

import numpy as np
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions
from PIL import Image

from engine.request import BatchKey, GenerationRequest, RequestBatch, RequestOutput, SamplingParams
from pipelines.base import Modality, PipelineConfig
from pipelines.loading import load_diffusers
from pipelines.qwen_edit_loading import load_qwen_image_edit
from pipelines.qwen_image import QwenImageTextToImage

# The area QwenImageEditPipeline resizes its condition image to.
_CONDITION_AREA = 1024 * 1024


def condition_size(image: np.ndarray) -> tuple[int, int]:
    """(width, height) the pipeline gives the condition image made from `image`."""
    height, width = image.shape[:2]
    calculated_width, calculated_height, _ = calculate_dimensions(_CONDITION_AREA, width / height)
    return int(calculated_width), int(calculated_height)


class QwenImageEdit(QwenImageTextToImage):
    modality: ClassVar[Modality] = "edit"
    # The edit's image conditioning is not in Qwen-Image's stages yet: request-level only.
    supports_step_batch: ClassVar[bool] = False
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
        # One input image per generated image, in the order prompts were expanded.
        images = [
            Image.fromarray(request.input_images[0])
            for request in batch.requests
            for _ in range(request.params.n)
        ]
        return {"image": images}


class QwenImageEditPlus(QwenImageEdit):
    """Several input images per request (1 to 3); diffusers refuses batches of prompts."""

    supports_request_batch: ClassVar[bool] = False
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
