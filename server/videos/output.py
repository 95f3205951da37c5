"""A finished video job's files: the MP4, its thumbnail and spritesheet, and the input image
a remix starts from, each written whole to the output store."""

from __future__ import annotations

import io
from typing import Any

import numpy as np
from PIL import Image

from engine.request import RequestOutput
from server.jobs.files import VideoFiles
from server.media import encode_image
from server.videos.encoding import encode_mp4, first_frame_png, spritesheet_png


def write_outputs(
    files: VideoFiles, job_id: str, output: RequestOutput, fps: int, reference: Any | None
) -> None:
    """Blocking: call it off the event loop."""
    frames = output.images[0]
    # Families with sound (LTX-2) give one track per video, aligned with `images`.
    audio = output.extras.get("audio", [None])[0]
    data = encode_mp4(frames, fps, audio=audio, sample_rate=output.extras.get("sample_rate", [16000])[0])
    files.write(job_id, "thumbnail", first_frame_png(frames))
    files.write(job_id, "spritesheet", spritesheet_png(frames))
    if reference is not None:  # what a remix starts from: lossless, as the model got it
        files.write(job_id, "reference", encode_image(reference, "png"))
    # The MP4 last: once it is there, so is everything else.
    files.write(job_id, "video", data)


def read_reference(files: VideoFiles, job_id: str) -> np.ndarray:
    """The input image a job kept for remixes (`FileNotFoundError` if it has none)."""
    with Image.open(io.BytesIO(files.read(job_id, "reference")), formats=("PNG",)) as image:
        return np.asarray(image.convert("RGB"), dtype=np.uint8)
