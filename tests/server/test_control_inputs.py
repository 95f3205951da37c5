"""Reading a controlled video's inputs (Wan VACE's control video, mask, references) from a
form or a JSON body, without a model."""

from __future__ import annotations

import asyncio
import base64
import io

import numpy as np
import pytest
from starlette.datastructures import FormData, Headers, UploadFile

from server.errors import APIError
from server.videos.control_inputs import ControlInputs, decode_video, from_form, from_json
from server.videos.encoding import encode_mp4
from tests.media import png

MAX_BYTES, MAX_PIXELS = 2**24, 4096 * 4096


def frames(count: int = 5, side: int = 32) -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, (count, side, side, 3), dtype=np.uint8)


def upload(name: str, data: bytes, media_type: str) -> UploadFile:
    return UploadFile(io.BytesIO(data), filename=name, headers=Headers({"content-type": media_type}))


def test_a_form_brings_the_video_a_mask_and_references() -> None:
    form = FormData(
        [
            ("video", upload("control.mp4", encode_mp4(frames(), 16), "video/mp4")),
            ("mask", upload("mask.png", png(32, 32, mode="L"), "image/png")),
            ("reference_images[]", upload("a.png", png(40, 24), "image/png")),
            ("reference_images[]", upload("b.png", png(16, 16), "image/png")),
        ]
    )
    inputs = asyncio.run(from_form(form, MAX_BYTES, MAX_PIXELS))
    assert inputs.video is not None and inputs.video.shape == (5, 32, 32, 3)
    assert inputs.mask is not None and inputs.mask.shape == (32, 32) and (inputs.mask == 255).all()
    assert [image.shape for image in inputs.references] == [(24, 40, 3), (16, 16, 3)]
    assert not ControlInputs().given and inputs.given


def test_json_brings_data_urls_and_a_video_of_masks() -> None:
    masks = np.zeros((5, 32, 32, 3), np.uint8)
    masks[:, :, 16:] = 255

    def url(data: bytes, kind: str) -> str:
        return f"data:{kind};base64," + base64.b64encode(data).decode()

    fields = {
        "prompt": "x",
        "video": url(encode_mp4(frames(), 16), "video/mp4"),
        "mask": url(encode_mp4(masks, 16), "video/mp4"),
        "reference_images": [url(png(8, 8), "image/png")],
    }
    inputs = asyncio.run(from_json(fields, MAX_BYTES, MAX_PIXELS))
    assert fields == {"prompt": "x"}
    assert inputs.mask is not None and inputs.mask.shape == (5, 32, 32)
    assert inputs.mask[:, :, :12].max() < 64 and inputs.mask[:, :, 20:].min() > 192  # lossy, still binary
    assert len(inputs.references) == 1


def test_what_is_not_a_video_is_a_400_naming_the_field() -> None:
    with pytest.raises(APIError) as raised:
        decode_video(png(8, 8), "video", MAX_PIXELS)
    assert raised.value.status == 400 and raised.value.param == "video"
    with pytest.raises(APIError) as raised:
        decode_video(encode_mp4(frames(), 16), "video", 16 * 16)
    assert raised.value.status == 413
    with pytest.raises(APIError) as raised:
        asyncio.run(from_json({"video": "https://example.com/a.mp4"}, MAX_BYTES, MAX_PIXELS))
    assert raised.value.param == "video"
