"""The video job table: states, paging, restarts and expiry, without a server."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from server.routes.videos import POLL_MAX_MS, POLL_MIN_MS, POLL_QUEUED_MS, poll_after_ms
from server.video_jobs import VideoJob, VideoJobStore, VideoStatus


def test_lifecycle_restart_and_expiry(tmp_path: Path) -> None:
    store = VideoJobStore(tmp_path, ttl_s=3600)
    done = store.create(model="m", prompt="a", seconds="4", size="32x32")
    running = store.create(model="m", prompt="b", seconds="4", size="32x32")
    queued = store.create(model="m", prompt="c", seconds="4", size="32x32")
    store.mark_running(done.id)
    store.set_progress(done.id, 40)
    assert store.get(done.id).progress == 40  # type: ignore[union-attr]
    store.complete(done.id)
    store.mark_running(running.id)
    store.fail(done.id, "late", "a finished job cannot fail")
    assert store.get(done.id).status == "completed"  # type: ignore[union-attr]
    store.close()

    reopened = VideoJobStore(tmp_path, ttl_s=0.1)  # a restart; jobs completed from now on expire at once
    assert reopened.fail_interrupted() == 2
    for job_id in (running.id, queued.id):
        job = reopened.get(job_id)
        assert job is not None and job.status == "failed" and job.error_code == "server_restarted"
    page, more = reopened.page(after=None, limit=2, order="asc")
    assert [j.id for j in page] == [done.id, running.id] and more
    # A job ends once: a job failed by the restart never turns completed afterwards.
    assert reopened.complete(running.id) is False
    assert reopened.get(running.id).status == "failed"  # type: ignore[union-attr]
    short = reopened.create(model="m", prompt="d", seconds="4", size="32x32")
    assert reopened.complete(short.id) is True
    reopened.video_path(short.id).write_bytes(b"mp4")
    # The completed job and both failed ones (they expire like videos) are gone.
    assert reopened.purge_expired() == 3
    assert reopened.get(short.id) is None and not reopened.video_path(short.id).exists()
    assert reopened.get(running.id) is None
    assert reopened.get(done.id) is not None  # completed with a one-hour lifetime: kept


def test_files_no_job_owns_are_purged_once_unused(tmp_path: Path) -> None:
    store = VideoJobStore(tmp_path, ttl_s=3600)
    kept = store.create(model="m", prompt="a", seconds="4", size="32x32")
    store.video_path(kept.id).write_bytes(b"mp4")
    deleted = store.create(model="m", prompt="b", seconds="4", size="32x32")
    store.delete(deleted.id, keep_files=True)  # a download had just opened them
    store.video_path(deleted.id).write_bytes(b"mp4")
    store.thumbnail_path(deleted.id).write_bytes(b"png")
    store.partial_path(kept.id).write_bytes(b"half")  # a crash mid-write
    writing = store.create(model="m", prompt="c", seconds="4", size="32x32")
    store.partial_path(writing.id).write_bytes(b"half")
    assert store.purge_orphans(set(), min_age_s=60) == 0  # too fresh: maybe still in use
    assert store.purge_orphans({deleted.id, kept.id, writing.id}, min_age_s=0) == 0
    assert store.purge_orphans({writing.id}, min_age_s=0) == 3
    assert store.video_path(kept.id).exists() and store.partial_path(writing.id).exists()
    assert not store.video_path(deleted.id).exists() and not store.partial_path(kept.id).exists()


def test_the_poll_interval_follows_what_is_left() -> None:
    def job(status: VideoStatus, progress: int) -> VideoJob:
        return VideoJob("v", status, progress, 1000, None, None, "m", "p", "4", "32x32", None, None)

    assert poll_after_ms(job("queued", 0), 1010) == POLL_QUEUED_MS
    assert poll_after_ms(job("in_progress", 50), 1010) == 2500  # 10 s done, 10 s left: a quarter
    assert poll_after_ms(job("in_progress", 99), 1010) == POLL_MIN_MS
    assert poll_after_ms(job("in_progress", 1), 2000) == POLL_MAX_MS
    assert poll_after_ms(job("completed", 100), 2000) is None


def test_a_table_from_before_remix_gains_its_columns_and_keeps_its_rows(tmp_path: Path) -> None:
    with sqlite3.connect(tmp_path / "videos.sqlite3") as old:
        old.execute(
            "CREATE TABLE videos (id TEXT PRIMARY KEY, status TEXT NOT NULL, progress INTEGER NOT NULL "
            "DEFAULT 0, created_at INTEGER NOT NULL, completed_at INTEGER, expires_at INTEGER, model TEXT "
            "NOT NULL, prompt TEXT NOT NULL, seconds TEXT NOT NULL, size TEXT NOT NULL, error_code TEXT, "
            "error_message TEXT, seq INTEGER NOT NULL)"
        )
        old.execute(
            "INSERT INTO videos (id, status, created_at, model, prompt, seconds, size, seq) "
            "VALUES ('video_old', 'completed', 1, 'm', 'p', '4', '48x32', 1)"
        )
    old.close()
    store = VideoJobStore(tmp_path, ttl_s=60)
    try:
        kept = store.get("video_old")
        assert kept is not None and kept.status == "completed" and kept.settings is None
        new = store.create(
            model="m", prompt="q", seconds="4", size="48x32", settings="{}", remixed_from="video_old"
        )
        assert (new.settings, new.remixed_from) == ("{}", "video_old")
    finally:
        store.close()
