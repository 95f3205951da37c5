"""The video base: the text-to-image adapter plus frames. Wan (`pipelines/wan.py`) and
LTX-Video / LTX-2 (`pipelines/ltx.py`) build on it.

Everything about batching is inherited: one diffusers call per batch, one generator per
video, outputs split per request. What video adds: a frame count (from the request's
duration and fps, rounded up to a length the VAE can make) and, for LTX, a frame rate
that the transformer sees; both are in the batch key when they change the computation.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, ClassVar

from engine.request import BatchKey, GenerationRequest, InvalidRequestError, SamplingParams
from pipelines.base import Modality
from pipelines.outputs import resolved
from pipelines.text_to_image import DiffusersTextToImage

MAX_FRAMES = 1024


class DiffusersTextToVideo(DiffusersTextToImage):
    modality: ClassVar[Modality] = "video"
    accepts_frames: ClassVar[bool] = True
    per_prompt_argument: ClassVar[str] = "num_videos_per_prompt"
    default_fps: ClassVar[int] = 16
    default_num_frames: ClassVar[int] = 81
    # The diffusers `__call__` defaults: these pipelines have no config-derived default size.
    default_video_size: ClassVar[tuple[int, int]] = (832, 480)
    # check_inputs refuses other sizes (it is not derived from the VAE in diffusers).
    video_size_multiple: ClassVar[int] = 16

    def model_default_size(self) -> tuple[int, int]:
        return self.default_video_size

    def model_size_multiple(self) -> int:
        return self.video_size_multiple

    def frame_step(self) -> int:
        """Frame counts must be `frame_step * k + 1` (the VAE's temporal compression)."""
        return int(self.pipe.vae_scale_factor_temporal)

    def resolve(self, request: GenerationRequest) -> SamplingParams:
        params = super().resolve(request)
        fps = params.fps or self.default_fps
        num_frames = params.num_frames
        if num_frames is None and params.duration_s is not None:
            # Round up: a video is never shorter than asked.
            step = self.frame_step()
            num_frames = math.ceil(params.duration_s * fps / step) * step + 1
        return replace(params, fps=fps, num_frames=num_frames or self.default_num_frames)

    def validate(self, params: SamplingParams) -> None:
        super().validate(params)
        frames, step = resolved(params.num_frames), self.frame_step()
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

    def default_params(self) -> SamplingParams:
        return replace(super().default_params(), num_frames=self.default_num_frames)

    def batch_key(self, request: GenerationRequest) -> BatchKey:
        return (*super().batch_key(request), request.params.num_frames)

    def family_kwargs(self, params: SamplingParams) -> dict[str, Any]:
        return {"num_frames": params.num_frames}

    def outputs_of(self, result: Any) -> Any:
        return result.frames
