"""OpenAI wire schemas of the Videos API (`/v1/videos`): what a create or a remix sends,
and the video objects answered. The fields every generation endpoint shares are
`server.protocol`'s."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator

from server.protocol import GenerationFields, OnePrompt


class VideoCreateRequest(GenerationFields):
    """`POST /v1/videos` (multipart, as the official client sends it, or JSON).

    `seconds` and `fps` decide the frame count, which the model rounds up to a length it
    can make (4k+1 frames for Wan, 8k+1 for LTX-Video).
    """

    # OpenAI's API types it as a string ("4"): in JSON a number or a numeric string.
    seconds: float = Field(4.0, gt=0, le=60, allow_inf_nan=False, strict=False)
    fps: int | None = Field(None, ge=1, le=60)
    # An extension: where this job's video.completed / video.failed event goes (besides the
    # server's --webhook-url); only to hosts the server allows (--allowed-webhook-hosts).
    webhook_url: str | None = Field(None, max_length=2048)
    # Two-expert models (Wan 2.2 A14B): the low-noise expert's guidance (default: the model's).
    guidance_scale_2: float | None = Field(None, allow_inf_nan=False)
    # Controlled video (Wan VACE): how strongly the control video and references steer (default 1).
    conditioning_scale: float | None = Field(None, allow_inf_nan=False)

    @field_validator("seconds", mode="before")
    @classmethod
    def _seconds_not_a_boolean(cls, value: Any) -> Any:
        if isinstance(value, bool):  # lax conversion would take true for 1 second
            raise ValueError('must be a number of seconds such as 4 or "4", not a boolean')
        return value


class VideoRemixRequest(OnePrompt):
    """`POST /v1/videos/{video_id}/remix`: the new prompt; everything else (size, seconds,
    steps, guidance, negative prompt, seed) comes from the source video."""


class VideoError(BaseModel):
    code: str
    message: str


class VideoObject(BaseModel):
    id: str
    object: Literal["video"] = "video"
    status: Literal["queued", "in_progress", "completed", "failed"]
    progress: int
    created_at: int
    completed_at: int | None = None
    expires_at: int | None = None
    model: str
    prompt: str
    seconds: str
    size: str
    error: VideoError | None = None
    remixed_from_video_id: str | None = None


class VideoList(BaseModel):
    object: Literal["list"] = "list"
    data: list[VideoObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class VideoDeleted(BaseModel):
    id: str
    object: Literal["video.deleted"] = "video.deleted"
    deleted: bool = True
