"""Video jobs: an SQLite table under `--output-dir` plus one MP4 per completed job.

Videos take long, so `POST /v1/videos` answers at once with a job that clients poll. The
table survives restarts, so completed videos stay downloadable; jobs that were queued or
running when the server stopped are marked failed at the next start-up, never left
`in_progress` forever. Calls are short single-row statements (microseconds), made from the
event loop; the connection is used from that one thread only.
"""

from __future__ import annotations

import secrets
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

VideoStatus = Literal["queued", "in_progress", "completed", "failed"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS videos (
    id TEXT PRIMARY KEY,
    status TEXT NOT NULL,
    progress INTEGER NOT NULL DEFAULT 0,
    created_at INTEGER NOT NULL,
    completed_at INTEGER,
    expires_at INTEGER,
    model TEXT NOT NULL,
    prompt TEXT NOT NULL,
    seconds TEXT NOT NULL,
    size TEXT NOT NULL,
    error_code TEXT,
    error_message TEXT,
    seq INTEGER NOT NULL,
    settings TEXT,
    remixed_from TEXT
)
"""
# Columns added after the first release, with their types: added to an older table at open.
_ADDED_COLUMNS = {"settings": "TEXT", "remixed_from": "TEXT"}
_COLUMNS = (
    "id, status, progress, created_at, completed_at, expires_at, model, prompt, seconds, size, "
    "error_code, error_message, settings, remixed_from"
)


@dataclass(frozen=True, slots=True)
class VideoJob:
    id: str
    status: VideoStatus
    progress: int
    created_at: int
    completed_at: int | None
    expires_at: int | None
    model: str
    prompt: str
    seconds: str
    size: str
    error_code: str | None
    error_message: str | None
    # The create request's settings as JSON (all but the prompt, with the seed it ran with,
    # and whether it had an input_reference, kept in `reference_path`): what a remix
    # repeats. None for jobs recorded before remix existed.
    settings: str | None = None
    remixed_from: str | None = None


class VideoJobStore:
    def __init__(self, directory: Path, ttl_s: float) -> None:
        self.directory = directory
        self.ttl_s = ttl_s
        directory.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(directory / "videos.sqlite3", isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute(_SCHEMA)
        known = {row[1] for row in self._db.execute("PRAGMA table_info(videos)")}
        for column, kind in _ADDED_COLUMNS.items():
            if column not in known:  # a table from an older version: keep its rows
                self._db.execute(f"ALTER TABLE videos ADD COLUMN {column} {kind}")

    def close(self) -> None:
        self._db.close()

    def video_path(self, job_id: str) -> Path:
        return self.directory / f"{job_id}.mp4"

    def thumbnail_path(self, job_id: str) -> Path:
        return self.directory / f"{job_id}.png"

    def spritesheet_path(self, job_id: str) -> Path:
        return self.directory / f"{job_id}.sprites.png"

    def reference_path(self, job_id: str) -> Path:
        """The job's input image as the model used it (image-to-video), kept for remixes."""
        return self.directory / f"{job_id}.reference.png"

    def create(
        self,
        *,
        model: str,
        prompt: str,
        seconds: str,
        size: str,
        settings: str | None = None,
        remixed_from: str | None = None,
    ) -> VideoJob:
        job_id = f"video_{secrets.token_hex(16)}"
        seq = self._db.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM videos").fetchone()[0]
        self._db.execute(
            "INSERT INTO videos (id, status, progress, created_at, model, prompt, seconds, size, seq, "
            "settings, remixed_from) VALUES (?, 'queued', 0, ?, ?, ?, ?, ?, ?, ?, ?)",
            (job_id, int(time.time()), model, prompt, seconds, size, seq, settings, remixed_from),
        )
        return self._require(job_id)

    def get(self, job_id: str) -> VideoJob | None:
        row = self._db.execute(f"SELECT {_COLUMNS} FROM videos WHERE id = ?", (job_id,)).fetchone()
        return None if row is None else VideoJob(*row)

    def page(
        self, *, after: str | None, limit: int, order: Literal["asc", "desc"]
    ) -> tuple[list[VideoJob], bool]:
        """One page in creation order; returns (jobs, has_more). `KeyError` for an `after`
        that names no job (deleted, expired or never made): its place in the order is gone
        with its row, and an empty page would read as the end of the list."""
        op, direction = (">", "ASC") if order == "asc" else ("<", "DESC")
        where = ""
        args: tuple[int, ...] = ()
        if after is not None:
            row = self._db.execute("SELECT seq FROM videos WHERE id = ?", (after,)).fetchone()
            if row is None:
                raise KeyError(after)
            where = f"WHERE seq {op} ?"
            args = (row[0],)
        rows = self._db.execute(
            f"SELECT {_COLUMNS} FROM videos {where} ORDER BY seq {direction} LIMIT ?", (*args, limit + 1)
        ).fetchall()
        return [VideoJob(*row) for row in rows[:limit]], len(rows) > limit

    def mark_running(self, job_id: str) -> None:
        self._db.execute(
            "UPDATE videos SET status = 'in_progress' WHERE id = ? AND status = 'queued'", (job_id,)
        )

    def set_progress(self, job_id: str, progress: int) -> None:
        self._db.execute(
            "UPDATE videos SET progress = ? WHERE id = ? AND status = 'in_progress'", (progress, job_id)
        )

    # A job ends once: completed or failed, only from queued or in_progress, and it expires
    # ttl_s later either way (a failed job's row is kept as long as a video would be).

    def complete(self, job_id: str) -> bool:
        """Mark the job completed; False if it had already ended (or was deleted)."""
        now = int(time.time())
        cursor = self._db.execute(
            "UPDATE videos SET status = 'completed', progress = 100, completed_at = ?, expires_at = ? "
            "WHERE id = ? AND status IN ('queued', 'in_progress')",
            (now, now + int(self.ttl_s), job_id),
        )
        return cursor.rowcount > 0

    def fail(self, job_id: str, code: str, message: str) -> None:
        now = int(time.time())
        self._db.execute(
            "UPDATE videos SET status = 'failed', completed_at = ?, expires_at = ?, error_code = ?, "
            "error_message = ? WHERE id = ? AND status IN ('queued', 'in_progress')",
            (now, now + int(self.ttl_s), code, message, job_id),
        )

    def delete(self, job_id: str, *, keep_files: bool = False) -> bool:
        """Remove the row and, unless a download still reads them (`keep_files`), the files;
        files left behind are removed by `purge_orphans` once nothing uses them."""
        deleted = self._db.execute("DELETE FROM videos WHERE id = ?", (job_id,)).rowcount > 0
        if not keep_files:
            self.remove_files(job_id)
        return deleted

    def remove_files(self, job_id: str) -> None:
        files = (
            self.video_path(job_id),
            self.thumbnail_path(job_id),
            self.spritesheet_path(job_id),
            self.reference_path(job_id),
        )
        for path in (*files, self.partial_path(job_id)):
            path.unlink(missing_ok=True)

    def partial_path(self, job_id: str) -> Path:
        """Where the MP4 is written before it is renamed into place."""
        return self.directory / f"{job_id}.mp4.part"

    def exists(self, job_id: str) -> bool:
        return self._db.execute("SELECT 1 FROM videos WHERE id = ?", (job_id,)).fetchone() is not None

    def fail_interrupted(self) -> int:
        """At start-up: jobs a previous process left queued or running can never finish."""
        now = int(time.time())
        cursor = self._db.execute(
            "UPDATE videos SET status = 'failed', completed_at = ?, expires_at = ?, "
            "error_code = 'server_restarted', "
            "error_message = 'the server stopped before this video was finished; create it again' "
            "WHERE status IN ('queued', 'in_progress')",
            (now, now + int(self.ttl_s)),
        )
        return cursor.rowcount

    def purge_orphans(self, in_use: set[str], min_age_s: float = 60.0) -> int:
        """Remove files of jobs that no longer exist (deleted while their files were being
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
                if path.stat().st_mtime > cutoff or not (stale_part or not self.exists(job_id)):
                    continue
                path.unlink()
            except FileNotFoundError:
                continue
            removed += 1
        return removed

    def purge_expired(self) -> int:
        now = int(time.time())
        expired = [
            row[0]
            for row in self._db.execute(
                "SELECT id FROM videos WHERE expires_at IS NOT NULL AND expires_at <= ?", (now,)
            )
        ]
        for job_id in expired:
            self.delete(job_id)
        return len(expired)

    def _require(self, job_id: str) -> VideoJob:
        job = self.get(job_id)
        if job is None:
            raise KeyError(job_id)
        return job
