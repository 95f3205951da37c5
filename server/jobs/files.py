"""A video job's files on the output store: the MP4, its thumbnail and spritesheet, and the
input image a remix starts from (`videos/JOB_ID.*`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Literal

from starlette.responses import Response

from server.outputs.local import PARTIAL_SUFFIX
from server.outputs.store import OutputStore

Variant = Literal["video", "thumbnail", "spritesheet", "reference"]

_SUFFIX: dict[Variant, str] = {
    "video": ".mp4",
    "thumbnail": ".png",
    "spritesheet": ".sprites.png",
    # The job's input image as the model used it (image-to-video), kept for remixes.
    "reference": ".reference.png",
}
MEDIA_TYPES: dict[Variant, str] = {
    "video": "video/mp4",
    "thumbnail": "image/png",
    "spritesheet": "image/png",
    "reference": "image/png",
}


class VideoFiles:
    """Every call blocks (disk or network): call it off the event loop."""

    def __init__(self, outputs: OutputStore, folder: str = "videos") -> None:
        self.outputs = outputs
        self.folder = folder

    def key(self, job_id: str, variant: Variant) -> str:
        return f"{self.folder}/{job_id}{_SUFFIX[variant]}"

    def write(self, job_id: str, variant: Variant, data: bytes) -> None:
        self.outputs.write(self.key(job_id, variant), data, MEDIA_TYPES[variant])

    def read(self, job_id: str, variant: Variant) -> bytes:
        """`FileNotFoundError` if the job has no such file."""
        return self.outputs.read(self.key(job_id, variant))

    def response(self, job_id: str, variant: Variant) -> Response | None:
        filename = f"{job_id}.mp4" if variant == "video" else None
        return self.outputs.response(self.key(job_id, variant), MEDIA_TYPES[variant], filename)

    def remove(self, job_id: str) -> None:
        keys = [self.key(job_id, variant) for variant in _SUFFIX]
        self.outputs.delete([*keys, *(key + PARTIAL_SUFFIX for key in keys if not self.outputs.shared)])

    def settled(self, in_use: set[str], min_age_s: float = 60.0) -> list[tuple[str, str]]:
        """(key, job id) of the files at least `min_age_s` old of jobs not `in_use` (running or
        being downloaded): those of jobs that no longer exist (deleted while their files were
        being written or read) and partial writes are orphans (`orphans`)."""
        cutoff = time.time() - min_age_s
        found = []
        for stored in self.outputs.listing(f"{self.folder}/video_"):
            job_id = stored.key.rpartition("/")[2].split(".", 1)[0]
            if job_id not in in_use and stored.modified <= cutoff:
                found.append((stored.key, job_id))
        return found


def orphans(settled: list[tuple[str, str]], exists: Callable[[str], bool]) -> list[str]:
    """The keys among `settled` files to remove: partial writes, and files of jobs that do
    not `exist` (each job asked once)."""
    known: dict[str, bool] = {}
    found = []
    for key, job_id in settled:
        if not key.endswith(PARTIAL_SUFFIX):
            if job_id not in known:
                known[job_id] = exists(job_id)
            if known[job_id]:
                continue
        found.append(key)
    return found
