"""A controlled video's inputs on `POST /v1/videos` (Wan VACE), extensions of OpenAI's API:
`video` (the control video: an MP4 or WebM file), `mask` (an image for every frame, or a
video of masks; white = redraw, black = keep, as diffusers reads it) and `reference_images`
(image files, repeatable as `reference_images[]`). JSON bodies send each as a data URL
(`data:video/mp4;base64,...`), `reference_images` as a list of them.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
from dataclasses import dataclass
from typing import Any

import av
import numpy as np
from PIL import Image, UnidentifiedImageError
from starlette.datastructures import FormData, UploadFile

from server.errors import APIError
from server.uploads import FORMATS, read_data_url, read_image, single_part

# The form parts this module reads (everything else is a field of the body).
CONTROL_FIELDS = ("video", "mask", "reference_images", "reference_images[]")
# Longer than any model's videos (the pipelines refuse more than 1024 frames).
MAX_FRAMES = 1024
# Decoded frames held at once: a 1024-frame 832x480 video is 1.2 GB.
MAX_DECODED_BYTES = 2 * 2**30
# Containers the decoder opens (PyAV names them by their demuxer); nothing else is parsed further.
_CONTAINERS = ("mov,mp4,m4a,3gp,3g2,mj2", "matroska,webm")


@dataclass(frozen=True)
class ControlInputs:
    video: np.ndarray | None = None  # uint8 FxHxWx3
    mask: np.ndarray | None = None  # uint8 HxW or FxHxW, 255 = redraw
    references: tuple[np.ndarray, ...] = ()

    @property
    def given(self) -> bool:
        return self.video is not None or self.mask is not None or bool(self.references)


async def from_form(form: FormData, max_bytes: int, max_pixels: int) -> ControlInputs:
    video = single_part(form, "video")
    mask = single_part(form, "mask")
    references = [*form.getlist("reference_images"), *form.getlist("reference_images[]")]
    return ControlInputs(
        video=None
        if video is None
        else await _video(await _bytes(video, "video", max_bytes), "video", max_pixels),
        mask=None if mask is None else await _mask(await _bytes(mask, "mask", max_bytes), max_pixels),
        references=tuple(
            [await _reference(value, "reference_images", max_bytes, max_pixels) for value in references]
        ),
    )


async def from_json(fields: dict[str, Any], max_bytes: int, max_pixels: int) -> ControlInputs:
    """The inputs popped from a JSON body's `fields`."""
    video, mask = fields.pop("video", None), fields.pop("mask", None)
    references = fields.pop("reference_images", None) or []
    if not isinstance(references, list):
        raise APIError(400, "reference_images must be a list of data URLs", param="reference_images")
    return ControlInputs(
        video=None
        if video is None
        else await _video(_data_url(video, "video", max_bytes), "video", max_pixels),
        mask=None if mask is None else await _mask(_data_url(mask, "mask", max_bytes), max_pixels),
        references=tuple(
            [await read_data_url(value, "reference_images", max_bytes, max_pixels) for value in references]
        ),
    )


async def _reference(value: Any, field: str, max_bytes: int, max_pixels: int) -> np.ndarray:
    if isinstance(value, UploadFile):
        return await read_image(value, field, max_bytes=max_bytes, max_pixels=max_pixels)
    return await read_data_url(value, field, max_bytes, max_pixels)


async def _bytes(value: Any, field: str, max_bytes: int) -> bytes:
    if not isinstance(value, UploadFile):
        return _data_url(value, field, max_bytes)
    data = await value.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise _too_large(field, max_bytes)
    return data


def _data_url(value: Any, field: str, max_bytes: int) -> bytes:
    if not isinstance(value, str) or not value.startswith("data:"):
        raise APIError(
            400,
            f"{field} must be an uploaded file or a base64 data URL; this server does not fetch URLs",
            param=field,
        )
    header, _, payload = value.partition(",")
    if not header.endswith(";base64"):
        raise APIError(400, f"{field}: a data URL must be base64", param=field)
    if len(payload) * 3 // 4 > max_bytes:
        raise _too_large(field, max_bytes)
    try:
        return base64.b64decode(payload, validate=True)
    except binascii.Error:
        raise APIError(400, f"{field}: the data URL is not valid base64", param=field) from None


def _too_large(field: str, max_bytes: int) -> APIError:
    return APIError(
        413,
        f"{field} is larger than this server's limit of {max_bytes} bytes",
        param=field,
        code="file_too_large",
    )


async def _video(data: bytes, field: str, max_pixels: int, *, gray: bool = False) -> np.ndarray:
    return await asyncio.to_thread(decode_video, data, field, max_pixels, gray=gray)


async def _mask(data: bytes, max_pixels: int) -> np.ndarray:
    """One mask image (HxW) or a video of masks (FxHxW), grayscale."""
    try:
        with Image.open(io.BytesIO(data), formats=FORMATS) as image:
            if image.width * image.height > max_pixels:
                raise APIError(
                    413, f"mask is more than this server's limit of {max_pixels} pixels", param="mask"
                )
            return np.asarray(image.convert("L"), dtype=np.uint8)
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError, ValueError):
        return await _video(data, "mask", max_pixels, gray=True)


def decode_video(data: bytes, field: str, max_pixels: int, *, gray: bool = False) -> np.ndarray:
    """Every frame of an MP4 or WebM video, uint8 FxHxWx3 RGB (FxHxW with `gray`)."""
    unreadable = APIError(
        400, f"{field} is not a video this server can read: send an MP4 or WebM", param=field
    )
    frames: list[np.ndarray] = []
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if container.format.name not in _CONTAINERS or not container.streams.video:
                raise unreadable
            for frame in container.decode(video=0):
                if frame.width * frame.height > max_pixels:
                    raise APIError(
                        413,
                        f"{field}'s frames are more than this server's limit of {max_pixels} pixels",
                        param=field,
                    )
                if (
                    len(frames) == MAX_FRAMES
                    or (len(frames) + 1) * frame.width * frame.height * 3 > MAX_DECODED_BYTES
                ):
                    raise APIError(
                        400, f"{field} has more frames than this server takes ({MAX_FRAMES})", param=field
                    )
                frames.append(frame.to_ndarray(format="gray" if gray else "rgb24"))
    except av.error.FFmpegError:
        raise unreadable from None
    if not frames or any(frame.shape != frames[0].shape for frame in frames):
        raise unreadable
    return np.stack(frames)
