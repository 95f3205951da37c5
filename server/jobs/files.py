"""A video job's files in `--output-dir`/videos: the MP4, its thumbnail and spritesheet, the
input image a remix starts from, and the `.part` each is written to before its rename."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path


class VideoFiles:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)

    def video_path(self, job_id: str) -> Path:
        return self.directory / f"{job_id}.mp4"

    def thumbnail_path(self, job_id: str) -> Path:
        return self.directory / f"{job_id}.png"

    def spritesheet_path(self, job_id: str) -> Path:
        return self.directory / f"{job_id}.sprites.png"

    def reference_path(self, job_id: str) -> Path:
        """The job's input image as the model used it (image-to-video), kept for remixes."""
        return self.directory / f"{job_id}.reference.png"

    def partial_path(self, job_id: str) -> Path:
        """Where each file is written before it is renamed into place."""
        return self.directory / f"{job_id}.mp4.part"

    def remove(self, job_id: str) -> None:
        files = (
            self.video_path(job_id),
            self.thumbnail_path(job_id),
            self.spritesheet_path(job_id),
            self.reference_path(job_id),
            self.partial_path(job_id),
        )
        for path in files:
            path.unlink(missing_ok=True)

    def purge_orphans(self, in_use: set[str], exists: Callable[[str], bool], min_age_s: float = 60.0) -> int:
        """Remove files of jobs that no longer `exist` (deleted while their files were being
        written or read) and `.part` files nobody is writing, once `min_age_s` old and not
        `in_use` (jobs running or being downloaded)."""
        removed = 0
        cutoff = time.time() - min_age_s
        for path in self.directory.glob("video_*"):
            job_id = path.name.split(".", 1)[0]
            if job_id in in_use:
                continue
            stale_part = path.name.endswith(".part")
            try:
                if path.stat().st_mtime > cutoff or not (stale_part or not exists(job_id)):
                    continue
                path.unlink()
            except FileNotFoundError:
                continue
            removed += 1
        return removed
