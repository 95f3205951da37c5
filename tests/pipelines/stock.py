"""diffusers as the oracle: a request's images from the pipeline's own `__call__`, called
as a diffusers user would call it for that request — one call per image with its CPU
generator, the request's fields as the call's arguments — not through the adapter's
request-level path, so a mistake in how we map a request onto diffusers shows.

The mapping below is the one the docs promise (docs/api.md, docs/models.md), written out
here once, apart from the adapter's own: the prompt, negative prompt (where given), steps,
size, guidance (`guidance_scale`; `true_cfg_scale` only with a negative prompt; HunyuanVideo
1.5's guider; Wan 2.2's second scale), frames and frame rate for videos, the input image at
the output size with its strength (image-to-image) or with its mask at strength 1, the kept
pixels put back outside the mask (inpainting), the reference images as sent (edits), the
control video, mask and conditioning scale (VACE). Where a family serves a model with an
argument other than the call's default, that argument is named here with its reason.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from PIL import Image

from engine.request import GenerationRequest, RequestOutput, SamplingParams
from pipelines.adapter import DiffusersAdapter
from pipelines.outputs import resolved


def stock_output(pipeline: DiffusersAdapter, request: GenerationRequest) -> RequestOutput:
    """`request`'s images (and LTX-2's audio tracks) from diffusers' own call, one image per
    call with that image's seed."""
    pipe, params = pipeline.pipe, request.params
    images: list[np.ndarray] = []
    audio: list[np.ndarray] = []
    for seed in params.image_seeds():
        kwargs = call_arguments(pipeline, request)
        with torch.inference_mode(), _guider(pipe, params):
            result = pipe(**kwargs, generator=torch.Generator("cpu").manual_seed(seed), output_type="np")
        generated = result.frames[0] if pipeline.modality == "video" else result.images[0]
        images.append(kept_outside_mask(request, (np.clip(generated, 0, 1) * 255).round().astype(np.uint8)))
        if getattr(result, "audio", None) is not None:
            audio.append(result.audio[0].float().cpu().numpy())
    extras: dict[str, list[Any]] = {}
    if audio:
        rate = int(pipe.vocoder.config.output_sampling_rate)
        extras = {"audio": audio, "sample_rate": [rate] * len(audio)}
    return RequestOutput(request.request_id, tuple(images), tuple(params.image_seeds()), extras=extras)


def call_arguments(pipeline: DiffusersAdapter, request: GenerationRequest) -> dict[str, Any]:
    """The arguments of one diffusers call for `request` (all but generator and output type)."""
    pipe, params = pipeline.pipe, request.params
    takes = inspect.signature(pipe.__call__).parameters
    kwargs: dict[str, Any] = {"prompt": request.prompt, "num_inference_steps": params.num_inference_steps}
    if params.negative_prompt is not None:
        kwargs["negative_prompt"] = params.negative_prompt
        if "true_cfg_scale" in takes and params.true_cfg_scale is not None:
            kwargs["true_cfg_scale"] = params.true_cfg_scale
    if "guidance_scale" in takes:
        kwargs["guidance_scale"] = params.guidance_scale
    if "width" in takes:
        kwargs |= {"width": params.width, "height": params.height}
    if pipeline.modality == "video":
        kwargs["num_frames"] = params.num_frames
    if "frame_rate" in takes:
        kwargs["frame_rate"] = params.fps
    if getattr(pipe, "transformer_2", None) is not None:  # Wan 2.2's low-noise expert
        kwargs["guidance_scale_2"] = params.guidance_scale_2
    return kwargs | _inputs(pipeline, request, takes) | _served_with(pipeline, params, takes)


def _inputs(pipeline: DiffusersAdapter, request: GenerationRequest, takes: Any) -> dict[str, Any]:
    """The request's pictures as the call takes them."""
    params, name = request.params, type(pipeline.pipe).__name__
    pictures = [Image.fromarray(image) for image in request.input_images]
    if name == "WanVACEPipeline":
        return _control(request, params)
    if "mask_image" in takes:  # inpainting: the input and its mask at the output size, all redrawn
        image, mask = _at_size(request)
        return {"image": Image.fromarray(image), "mask_image": Image.fromarray(mask), "strength": 1.0}
    if "strength" in takes:  # image-to-image: the input at the output size
        return {"image": Image.fromarray(_at_size(request)[0]), "strength": params.strength}
    if not pictures:
        return {}
    if name in ("QwenImageEditPlusPipeline", "QwenImage21Pipeline", "Flux2Pipeline", "Flux2KleinPipeline"):
        return {"image": pictures}  # several references, in order
    return {"image": pictures[0]}


def _control(request: GenerationRequest, params: SamplingParams) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"conditioning_scale": params.conditioning_scale}
    if params.conditioning_scale is None:
        del kwargs["conditioning_scale"]  # the call's own default
    if request.input_images:
        kwargs["reference_images"] = [Image.fromarray(image) for image in request.input_images]
    if request.control_video is not None:
        frames = request.control_video
        kwargs["video"] = [Image.fromarray(frame) for frame in frames]
        if request.mask is not None:
            masks = request.mask if request.mask.ndim == 3 else [request.mask] * len(frames)
            kwargs["mask"] = [Image.fromarray(mask) for mask in masks]
    return kwargs


def _served_with(pipeline: DiffusersAdapter, params: SamplingParams, takes: Any) -> dict[str, Any]:
    """Arguments a family serves its models with other than the call's defaults."""
    pipe, name = pipeline.pipe, type(pipeline.pipe).__name__
    kwargs: dict[str, Any] = {}
    if pipeline.config.timesteps:  # a distilled model's fixed schedule (`timesteps` in its preset)
        kwargs["timesteps"] = list(pipeline.config.timesteps)
    tokenizer = getattr(pipe, "tokenizer_2", None)
    if name.startswith("Flux") and tokenizer is not None and "max_sequence_length" in takes:
        # T5 without a mask: padded to what the model learnt (shapes-dit: 32), at most 512.
        kwargs["max_sequence_length"] = min(512, int(tokenizer.model_max_length))
    if name.startswith("Chroma"):
        kwargs["max_sequence_length"] = 512  # Chroma's T5 length (its img2img pipelines say 256)
    if name == "FluxKontextPipeline":
        # The reference at the output's area; Kontext's preferred sizes only for its 8x VAE.
        kwargs |= {
            "max_area": resolved(params.width) * resolved(params.height),
            "_auto_resize": pipe.vae_scale_factor == 8,
        }
    if name == "QwenImage21Pipeline":
        kwargs |= _qwen_image_21(pipeline, params)
    if name.startswith("ZImage"):
        # `--cfg-truncation` and `--cfg-normalization` as the family holds them (the call's own
        # defaults unless configured; tests/pipelines/test_z_image.py checks those are the same).
        family: Any = pipeline.family
        kwargs |= {"cfg_truncation": family.cfg_truncation, "cfg_normalization": family.cfg_normalization}
    return kwargs


def _qwen_image_21(pipeline: DiffusersAdapter, params: SamplingParams) -> dict[str, Any]:
    """The configured reference resolution, and the asked step count where the model's own
    sigma grid (`sample_sigmas`) has another (diffusers would take the grid whatever the count)."""
    kwargs: dict[str, Any] = {}
    resolution = pipeline.config.options.reference_resolution  # `--reference-resolution`
    if resolution is not None:
        kwargs["output_resolution"] = resolution
    sigmas = pipeline.pipe.config.get("sample_sigmas", None)
    steps = resolved(params.num_inference_steps)
    if sigmas is not None and len(sigmas) != steps:
        kwargs["sigmas"] = np.linspace(1.0, 1 / steps, steps).tolist()
    return kwargs


def _at_size(request: GenerationRequest) -> tuple[np.ndarray, np.ndarray]:
    """The input (Lanczos) and its mask (nearest; none: repaint all) at the output size."""
    size = (resolved(request.params.width), resolved(request.params.height))
    image = np.asarray(Image.fromarray(request.input_images[0]).resize(size, Image.Resampling.LANCZOS))
    if request.mask is None:
        return image, np.full(size[::-1], 255, np.uint8)
    return image, np.asarray(Image.fromarray(request.mask).resize(size, Image.Resampling.NEAREST))


def kept_outside_mask(request: GenerationRequest, generated: np.ndarray) -> np.ndarray:
    """Inpainting: the input's own pixels outside the mask, as the server returns them."""
    if request.mask is None or not request.input_images or request.control_video is not None:
        return generated
    image, mask = _at_size(request)
    return np.where(mask[..., None] < 128, image, generated)


@contextmanager
def _guider(pipe: Any, params: SamplingParams) -> Iterator[None]:
    """HunyuanVideo 1.5 takes its guidance scale from the pipeline's guider, not the call."""
    original = getattr(pipe, "guider", None)
    if original is None or params.guidance_scale is None:
        yield
        return
    pipe.guider = original.new(guidance_scale=params.guidance_scale)
    try:
        yield
    finally:
        pipe.guider = original
