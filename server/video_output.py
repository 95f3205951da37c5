"""A finished video job's files: the MP4, its thumbnail and spritesheet, and the input image
a remix starts from, each written aside and renamed into place."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from engine.request import RequestOutput
from server.jobs.files import VideoFiles
from server.media import encode_image
from server.video import encode_mp4, first_frame_png, spritesheet_png


def write_outputs(
    files: VideoFiles, job_id: str, output: RequestOutput, fps: int, reference: Any | None
) -> None:
    """Blocking: call it off the event loop."""
    frames = output.images[0]
    # Families with sound (LTX-2) give one track per video, aligned with `images`.
    audio = output.extras.get("audio", [None])[0]
    data = encode_mp4(frames, fps, audio=audio, sample_rate=output.extras.get("sample_rate", [16000])[0])
    # Written aside and renamed, so a reader never sees half a file; a .part left by a
    # crash is removed by purge_orphans.
    partial = files.partial_path(job_id)
    partial.write_bytes(first_frame_png(frames))
    partial.rename(files.thumbnail_path(job_id))
    partial.write_bytes(spritesheet_png(frames))
    partial.rename(files.spritesheet_path(job_id))
    if reference is not None:  # what a remix starts from: lossless, as the model got it
        partial.write_bytes(encode_image(reference, "png"))
        partial.rename(files.reference_path(job_id))
    partial.write_bytes(data)
    partial.rename(files.video_path(job_id))


def read_reference(path: Path) -> np.ndarray:
    """The input image a job kept for remixes."""
    with Image.open(path, formats=("PNG",)) as image:
        return np.asarray(image.convert("RGB"), dtype=np.uint8)
