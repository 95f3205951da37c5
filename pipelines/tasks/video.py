"""Text-to-video and image-to-video: text-to-image plus frames. A frame count (from the request's duration and
fps, rounded up to a length the VAE can make) is in the call and in both keys, since it is
part of the latent shape; the frame rate is the family's business (LTX's transformer sees
it)."""

from __future__ import annotations

import hashlib
import math
from dataclasses import replace
from typing import Any, ClassVar

import numpy as np
from PIL import Image

from engine.request import GenerationRequest, InvalidRequestError, RequestBatch, SamplingParams
from pipelines.base import Modality
from pipelines.inputs import reduce_image
from pipelines.outputs import resolved
from pipelines.stepping.setup import generators_for
from pipelines.stepping.state import DenoiseState, Encoded
from pipelines.tasks.base import Task
from pipelines.tasks.family import TaskFamily

MAX_FRAMES = 1024


class TextToVideo(Task):
    name: ClassVar[str] = "text-to-video"
    suffix: ClassVar[str] = "TextToVideo"
    modality: ClassVar[Modality] = "video"
    accepts_frames: ClassVar[bool] = True
    per_prompt_argument: ClassVar[str] = "num_videos_per_prompt"

    def complete(self, family: TaskFamily, params: SamplingParams) -> SamplingParams:
        fps = params.fps or family.default_fps
        num_frames = params.num_frames
        if num_frames is None and params.duration_s is not None:
            # Round up: a video is never shorter than asked.
            step = family.frame_step()
            num_frames = math.ceil(params.duration_s * fps / step) * step + 1
        return replace(params, fps=fps, num_frames=num_frames or family.default_num_frames)

    def validate(self, family: TaskFamily, params: SamplingParams) -> None:
        frames, step = resolved(params.num_frames), family.frame_step()
        if (frames - 1) % step:
            raise InvalidRequestError(
                f"num_frames must be {step}k+1 for this model (e.g. {step * 4 + 1}), got {frames}",
                "num_frames",
            )
        if frames > MAX_FRAMES:
            raise InvalidRequestError(
                f"the video would have {frames} frames; at most {MAX_FRAMES} (shorten seconds or lower fps)",
                "seconds",
            )

    def default_params(self, family: TaskFamily, params: SamplingParams) -> SamplingParams:
        return replace(params, num_frames=family.default_num_frames)

    def key_extras(self, family: TaskFamily, request: GenerationRequest) -> tuple[Any, ...]:
        return (request.params.num_frames,)

    def step_key_extras(self, family: TaskFamily, request: GenerationRequest) -> tuple[Any, ...]:
        return (request.params.num_frames,)

    def step_cost(self, family: TaskFamily, request: GenerationRequest, cost: int) -> int:
        # The generic cost counts a latent pixel per 8x8 pixels; a VAE that compresses 16x
        # (Wan 2.2 TI2V-5B, HunyuanVideo 1.5) makes a quarter of those.
        spatial = int(getattr(family.pipe, "vae_scale_factor_spatial", 8))
        return max(1, cost * 64 // (spatial * spatial))

    def call_kwargs(self, params: SamplingParams) -> dict[str, Any]:
        return {"num_frames": params.num_frames}

    def outputs_of(self, result: Any) -> Any:
        return result.frames


TEXT_TO_VIDEO = TextToVideo()


# The side of the image Wan 2.1 I2V's CLIP image encoder sees.
_CLIP_SIDE = 224


class ImageToVideo(TextToVideo):
    """Image-to-video: the request's input image is the first frame's reference.

    diffusers takes one image per call, shared by every prompt, so request-level batching
    shares a forward only between identical input images (a digest of the pixels is in the
    key). Step-level each request carries its own image's conditioning, made once at
    prepare (`TaskFamily.image_to_video_latents`), so any input images share a step; the step
    key stays the video's shape."""

    name: ClassVar[str] = "image-to-video"
    suffix: ClassVar[str] = "ImageToVideo"
    input_images: ClassVar[tuple[int, int]] = (1, 1)
    needs: ClassVar[tuple[str, ...]] = ("image_to_video_latents",)

    def size_from_inputs(self, family: TaskFamily, request: GenerationRequest) -> tuple[int, int] | None:
        # The engine resolves an imageless default request too (the step budget's measure).
        return family.size_from_image(request.input_images[0]) if request.input_images else None

    def reduce_inputs(self, family: TaskFamily, request: GenerationRequest) -> GenerationRequest:
        """The pipeline uses the image at the video's size (VAE) and at 224x224 (CLIP): a
        4096x4096 upload need not wait in the queue at full size. Reduced, aspect kept, to
        twice what either path needs, so their own resizing still starts from more pixels
        than it keeps (the output moves by resampling noise only)."""
        image = request.input_images[0]
        width, height = resolved(request.params.width), resolved(request.params.height)
        reduced = reduce_image(image, 2 * width, 2 * height, min_side=2 * _CLIP_SIDE)
        return request if reduced is image else replace(request, input_images=(reduced,))

    def key_extras(self, family: TaskFamily, request: GenerationRequest) -> tuple[Any, ...]:
        image = request.input_images[0]
        digest = request.input_digest or hashlib.sha256(np.ascontiguousarray(image).tobytes()).hexdigest()
        return (*super().key_extras(family, request), image.shape, digest)

    def input_kwargs(self, family: TaskFamily, batch: RequestBatch) -> dict[str, Any]:
        return {"image": Image.fromarray(batch.requests[0].input_images[0])}

    def prepare(self, family: TaskFamily, request: GenerationRequest, prompts: Encoded) -> DenoiseState:
        generators = generators_for(request)
        latents = family.image_to_video_latents(request, generators, prompts)
        return family.state(request, family.scheduler(request), latents, generators, prompts)


IMAGE_TO_VIDEO = ImageToVideo()
