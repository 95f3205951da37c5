"""Controlled video (Wan VACE): text-to-video steered by an optional control video, its mask
(white = redraw, black = keep) and reference images (a subject, a background).

The control video has the output's size and frame count (the request's size defaults to the
video's); a mask is one image for every frame or one per frame, at the video's size; each
reference image may have any size (the pipeline letterboxes it onto a white canvas of the
video's size) and becomes one more latent frame in front of the video, so the number of
references is part of the latent shape, hence of the step key, and of the step's cost.

diffusers takes one prompt and one generator per call, so request level runs one request
per call (`TaskUse.one_image_per_call`). Step level each request carries its own control
latents and `conditioning_scale` (made once at prepare, `TaskFamily.control_latents`), so
requests with different control videos, masks, scales and references of one count share a
step.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, ClassVar

import numpy as np
from PIL import Image

from engine.request import GenerationRequest, InvalidRequestError, RequestBatch, SamplingParams
from pipelines.inputs import reduce_image
from pipelines.outputs import resolved
from pipelines.stepping.setup import generators_for
from pipelines.stepping.state import DenoiseState, Encoded
from pipelines.tasks.family import TaskFamily
from pipelines.tasks.video import TextToVideo

# Each reference adds a latent frame to every step of the request; VACE's own examples use one
# to three (a subject, an object, a background).
MAX_REFERENCES = 3


class ControlVideo(TextToVideo):
    name: ClassVar[str] = "control-video"
    suffix: ClassVar[str] = "ControlVideo"
    input_images: ClassVar[tuple[int, int]] = (0, MAX_REFERENCES)
    accepts_mask: ClassVar[bool] = True
    accepts_control_video: ClassVar[bool] = True
    needs: ClassVar[tuple[str, ...]] = ("control_latents",)

    def size_from_inputs(self, family: TaskFamily, request: GenerationRequest) -> tuple[int, int] | None:
        if request.control_video is None:
            return None
        height, width = request.control_video.shape[1:3]
        return width, height

    def check_inputs(self, family: TaskFamily, request: GenerationRequest) -> None:
        """The control video must be what the request makes (its frames, its size): diffusers
        would otherwise rescale it and condition the video on misplaced latents."""
        video, mask, params = request.control_video, request.mask, request.params
        if video is None:
            if mask is not None:
                raise InvalidRequestError("a mask applies to a control video; send video too", "mask")
            return
        if not (isinstance(video, np.ndarray) and video.ndim == 4 and video.shape[-1] == 3):
            raise InvalidRequestError("video must be frames of RGB pixels", "video")
        frames, height, width = video.shape[:3]
        expected = resolved(self.complete(family, params).num_frames)
        if frames != expected:
            raise InvalidRequestError(
                f"the control video has {frames} frames; this request makes {expected} (from its seconds "
                "and fps): send a video of that many frames, or seconds and fps that make its count",
                "video",
            )
        step = family.size_multiple
        if params.width is None and params.height is None:
            if width % step or height % step:
                raise InvalidRequestError(
                    f"the control video is {width}x{height}; its sides must be multiples of {step}", "video"
                )
        elif (params.width, params.height) != (width, height):
            raise InvalidRequestError(
                f"the control video is {width}x{height} but the request asks for {params.width}x"
                f"{params.height}: send frames of the output's size, or leave size out",
                "video",
            )
        frame_masks = mask is not None and mask.ndim == 3 and mask.shape[0] == frames
        if mask is not None and (mask.shape[-2:] != (height, width) or not (mask.ndim == 2 or frame_masks)):
            raise InvalidRequestError(
                f"the mask must be one {width}x{height} image, or one per frame of the video ({frames})",
                "mask",
            )

    def complete(self, family: TaskFamily, params: SamplingParams) -> SamplingParams:
        params = super().complete(family, params)
        scale = 1.0 if params.conditioning_scale is None else params.conditioning_scale
        return replace(params, conditioning_scale=scale)

    def key_extras(self, family: TaskFamily, request: GenerationRequest) -> tuple[Any, ...]:
        return (*super().key_extras(family, request), request.params.conditioning_scale)

    def call_kwargs(self, params: SamplingParams) -> dict[str, Any]:
        return {**super().call_kwargs(params), "conditioning_scale": params.conditioning_scale}

    def step_key_extras(self, family: TaskFamily, request: GenerationRequest) -> tuple[Any, ...]:
        # References are latent frames in front of the video's.
        return (*super().step_key_extras(family, request), len(request.input_images))

    def step_cost(self, family: TaskFamily, request: GenerationRequest, cost: int) -> int:
        cost = super().step_cost(family, request, cost)
        frames = (resolved(request.params.num_frames) - 1) // family.frame_step() + 1
        return cost * (frames + len(request.input_images)) // frames

    def reduce_inputs(self, family: TaskFamily, request: GenerationRequest) -> GenerationRequest:
        """References reduced (aspect kept) to twice what their letterbox in the video keeps."""
        width, height = resolved(request.params.width), resolved(request.params.height)
        reduced = tuple(reduce_image(image, 2 * width, 2 * height) for image in request.input_images)
        unchanged = all(new is old for new, old in zip(reduced, request.input_images, strict=True))
        return request if unchanged else replace(request, input_images=reduced)

    def input_kwargs(self, family: TaskFamily, batch: RequestBatch) -> dict[str, Any]:
        return call_inputs(batch.requests[0])

    def prepare(self, family: TaskFamily, request: GenerationRequest, prompts: Encoded) -> DenoiseState:
        generators = generators_for(request)
        latents = family.control_latents(request, generators, prompts)
        return family.state(request, family.scheduler(request), latents, generators, prompts)


def call_inputs(request: GenerationRequest) -> dict[str, Any]:
    """The request's control video, mask and references as `WanVACEPipeline` takes them (PIL
    frames; the mask repeated over the frames where it is one image)."""
    kwargs: dict[str, Any] = {}
    if request.input_images:
        kwargs["reference_images"] = [Image.fromarray(image) for image in request.input_images]
    video = request.control_video
    if video is not None:
        kwargs["video"] = [Image.fromarray(frame) for frame in video]
        mask = request.mask
        if mask is not None:
            masks = mask if mask.ndim == 3 else [mask] * len(video)
            kwargs["mask"] = [Image.fromarray(frame) for frame in masks]
    return kwargs


CONTROL_VIDEO = ControlVideo()
