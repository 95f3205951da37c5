"""Text-to-image adapter over a diffusers pipeline (StableDiffusionPipeline first).

One diffusers call per batch: the batch's prompts and negative prompts as lists, each
request's n expanded into repeated prompts with one generator per image (never
`num_images_per_prompt` with a list: it pairs text masks with the wrong prompts in some
families), and the images split back per request in order.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, ClassVar, Self, TypeVar

import numpy as np
import torch
from diffusers import DiffusionPipeline

from engine.request import (
    BatchKey,
    InvalidRequestError,
    RequestBatch,
    RequestOutput,
    SamplingParams,
)
from pipelines.base import Pipeline, PipelineConfig
from pipelines.loading import load_diffusers

MAX_STEPS = 1000
_T = TypeVar("_T")


class DiffusersTextToImage(Pipeline):
    supports_request_batch: ClassVar[bool] = True
    # Family defaults, used when neither the request nor the config sets them.
    default_steps: ClassVar[int] = 50
    default_guidance_scale: ClassVar[float] = 7.5
    default_size_multiple: ClassVar[int] = 8

    def __init__(self, pipe: DiffusionPipeline, config: PipelineConfig) -> None:
        self.pipe = pipe
        self.config = config
        width, height = config.default_size or self._model_default_size()
        self.default_width, self.default_height = width, height
        self.steps = config.default_steps or self.default_steps
        guidance = config.default_guidance_scale
        self.guidance_scale = self.default_guidance_scale if guidance is None else guidance
        self.size_multiple = config.size_multiple or self.default_size_multiple

    @classmethod
    def load(cls, config: PipelineConfig) -> Self:
        return cls(load_diffusers(config), config)

    def _model_default_size(self) -> tuple[int, int]:
        unet = self.pipe.unet
        side = int(unet.config.sample_size) * int(self.pipe.vae_scale_factor)
        return side, side

    def resolve(self, params: SamplingParams) -> SamplingParams:
        return _replace_none(
            params,
            width=self.default_width,
            height=self.default_height,
            num_inference_steps=self.steps,
            guidance_scale=self.guidance_scale,
        )

    def validate(self, params: SamplingParams) -> None:
        width, height = resolved(params.width), resolved(params.height)
        for name, value in (("width", width), ("height", height)):
            if value % self.size_multiple:
                raise InvalidRequestError(
                    f"{name} must be a multiple of {self.size_multiple} for this model, got {value}",
                    name,
                )
        if width * height > self.config.max_pixels:
            raise InvalidRequestError(
                f"size {width}x{height} exceeds this server's limit of {self.config.max_pixels} pixels",
                "size",
            )
        if resolved(params.num_inference_steps) > MAX_STEPS:
            raise InvalidRequestError(
                f"num_inference_steps must be at most {MAX_STEPS}, got {params.num_inference_steps}",
                "num_inference_steps",
            )
        for name in ("num_frames", "fps"):
            if getattr(params, name) is not None:
                raise InvalidRequestError(f"{name} applies to video models; this model makes images", name)
        if params.true_cfg_scale is not None:
            raise InvalidRequestError("true_cfg_scale is not supported by this model", "true_cfg_scale")
        if params.lora is not None:
            raise InvalidRequestError("LoRA adapters are not supported by this server yet", "lora")

    def batch_key(self, params: SamplingParams) -> BatchKey:
        # diffusers cannot vary guidance per sample inside one call, so it is in the key.
        return (
            "text-to-image",
            params.width,
            params.height,
            params.num_inference_steps,
            params.guidance_scale,
            params.output_type,
            params.lora,
        )

    def forward(self, batch: RequestBatch) -> list[RequestOutput]:
        shared = batch.requests[0].params  # every key field is equal across the batch
        prompts: list[str] = []
        negatives: list[str] = []
        generators: list[torch.Generator] = []
        for request in batch.requests:
            for seed in request.params.image_seeds():
                prompts.append(request.prompt)
                negatives.append(request.params.negative_prompt or "")
                # CPU generators give the same noise on every device, so a seed reproduces
                # an image across machines.
                generators.append(torch.Generator("cpu").manual_seed(seed))
        with torch.inference_mode():
            result = self.pipe(
                prompt=prompts,
                negative_prompt=negatives,
                width=shared.width,
                height=shared.height,
                num_inference_steps=shared.num_inference_steps,
                guidance_scale=shared.guidance_scale,
                generator=generators,
                num_images_per_prompt=1,
                output_type="latent" if shared.output_type == "latent" else "np",
                **self.extra_call_kwargs(batch),
            )
        images = _to_arrays(result.images, shared.output_type)
        return split_outputs(batch, images)

    def extra_call_kwargs(self, batch: RequestBatch) -> dict[str, Any]:
        """Family-specific arguments of the diffusers call; none for Stable Diffusion."""
        return {}


def split_outputs(batch: RequestBatch, images: list[np.ndarray]) -> list[RequestOutput]:
    """Give each request its own n images, in batch order."""
    if len(images) != batch.num_images:
        raise RuntimeError(f"pipeline made {len(images)} images for a batch of {batch.num_images}")
    outputs: list[RequestOutput] = []
    start = 0
    for request in batch.requests:
        n = request.params.n
        outputs.append(
            RequestOutput(
                request_id=request.request_id,
                images=tuple(images[start : start + n]),
                seeds=tuple(request.params.image_seeds()),
            )
        )
        start += n
    return outputs


def resolved(value: _T | None) -> _T:
    """A parameter that `resolve` has filled in; None here is a bug, not bad input."""
    if value is None:
        raise RuntimeError("sampling parameters were not resolved before use")
    return value


def _to_arrays(images: Any, output_type: str) -> list[np.ndarray]:
    if output_type == "latent":
        return [latent.float().cpu().numpy() for latent in images]
    # diffusers' "np" output is float in [0, 1]; round to the nearest 8-bit level.
    return [(np.clip(image, 0.0, 1.0) * 255.0).round().astype(np.uint8) for image in images]


def _replace_none(params: SamplingParams, **defaults: Any) -> SamplingParams:
    changes = {name: value for name, value in defaults.items() if getattr(params, name) is None}
    return replace(params, **changes) if changes else params
