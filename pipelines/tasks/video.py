"""Text-to-video: text-to-image plus frames. A frame count (from the request's duration and
fps, rounded up to a length the VAE can make) is in the call and in both keys, since it is
part of the latent shape; the frame rate is the family's business (LTX's transformer sees
it)."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING, Any, ClassVar

from engine.request import GenerationRequest, InvalidRequestError, SamplingParams
from pipelines.base import Modality
from pipelines.outputs import resolved
from pipelines.tasks.base import Task

if TYPE_CHECKING:
    from pipelines.families.base import Family

MAX_FRAMES = 1024


class TextToVideo(Task):
    name: ClassVar[str] = "text-to-video"
    suffix: ClassVar[str] = "TextToVideo"
    modality: ClassVar[Modality] = "video"
    accepts_frames: ClassVar[bool] = True
    per_prompt_argument: ClassVar[str] = "num_videos_per_prompt"

    def complete(self, family: Family, params: SamplingParams) -> SamplingParams:
        fps = params.fps or family.default_fps
        num_frames = params.num_frames
        if num_frames is None and params.duration_s is not None:
            # Round up: a video is never shorter than asked.
            step = family.frame_step()
            num_frames = math.ceil(params.duration_s * fps / step) * step + 1
        return replace(params, fps=fps, num_frames=num_frames or family.default_num_frames)

    def validate(self, family: Family, params: SamplingParams) -> None:
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

    def default_params(self, family: Family, params: SamplingParams) -> SamplingParams:
        return replace(params, num_frames=family.default_num_frames)

    def key_extras(self, family: Family, request: GenerationRequest) -> tuple[Any, ...]:
        return (request.params.num_frames,)

    def step_key_extras(self, family: Family, request: GenerationRequest) -> tuple[Any, ...]:
        return (request.params.num_frames,)

    def call_kwargs(self, params: SamplingParams) -> dict[str, Any]:
        return {"num_frames": params.num_frames}

    def outputs_of(self, result: Any) -> Any:
        return result.frames


TEXT_TO_VIDEO = TextToVideo()
