"""A video job's row and files stay in step: a job that cannot be recorded never runs,
files written or read while a job is deleted do not outlive it, downloads of vanished
files are 404, the cleanup survives its errors, and an unreadable job table does not stop
a server that may serve images only."""

from __future__ import annotations

import asyncio
import logging
import socket
import sqlite3
import threading
from pathlib import Path
from typing import Any

import pytest

import server.app
from server.app import purge_forever, purge_interval_s
from server.videos.service import VideoService
from tests.polling import until
from tests.server.conftest import settings_for
from tests.server.test_videos_api import Harness, poll


async def test_a_job_whose_row_cannot_be_written_never_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    harness = Harness(tmp_path)
    async with harness as client:
        service = harness.app.state.diffbatch.videos
        assert isinstance(service, VideoService)

        async def disk_full(**_: Any) -> Any:
            raise sqlite3.OperationalError("database or disk is full")

        monkeypatch.setattr(service.store, "create", disk_full)
        response = await client.post("/v1/videos", json={"prompt": "a", "seconds": 1})
        assert response.status_code == 500 and response.json()["error"]["code"] == "storage_error"
        engine = harness.app.state.diffbatch.engine
        await until(lambda: engine.stats.requests_aborted == 1, "the job's request is aborted")
        assert engine.scheduler.num_waiting == 0
    assert harness.pipeline.forwards == []


async def test_a_job_deleted_while_its_files_are_written_leaves_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    writing, release = threading.Event(), threading.Event()
    original = VideoService._write_files

    def slow_write(self: VideoService, *args: Any) -> None:
        writing.set()
        release.wait(10)
        original(self, *args)

    monkeypatch.setattr(VideoService, "_write_files", slow_write)
    harness = Harness(tmp_path)
    async with harness as client:
        job = (await client.post("/v1/videos", json={"prompt": "a", "seconds": 1})).json()
        await asyncio.to_thread(writing.wait, 10)
        assert (await client.delete(f"/v1/videos/{job['id']}")).status_code == 200
        release.set()
        service = harness.app.state.diffbatch.videos
        await until(lambda: job["id"] not in service.in_use(), "the deleted job's files are released")
        assert list((tmp_path / "videos").glob(f"{job['id']}*")) == []


async def test_a_download_racing_a_delete_gets_the_file_or_a_404(tmp_path: Path) -> None:
    harness = Harness(tmp_path)
    async with harness as client:
        for _ in range(5):
            job = (await client.post("/v1/videos", json={"prompt": "a", "seconds": 1})).json()
            await poll(client, job["id"], {"completed"})
            download, deletion = await asyncio.gather(
                client.get(f"/v1/videos/{job['id']}/content"), client.delete(f"/v1/videos/{job['id']}")
            )
            assert deletion.status_code == 200
            assert download.status_code in (200, 404), download.text
            if download.status_code == 200:
                assert download.content.startswith(b"\x00\x00\x00")  # a whole MP4 (ftyp box)
        # A file gone from disk (an operator, a full-disk cleanup) is a 404, not a 500.
        job = (await client.post("/v1/videos", json={"prompt": "b", "seconds": 1})).json()
        await poll(client, job["id"], {"completed"})
        (tmp_path / "videos" / f"{job['id']}.mp4").unlink()
        missing = await client.get(f"/v1/videos/{job['id']}/content")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"


async def test_the_cleanup_survives_an_error_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    harness = Harness(tmp_path)
    async with harness:
        state = harness.app.state.diffbatch
        calls = 0

        def flaky() -> int:
            nonlocal calls
            calls += 1
            if calls == 1:
                raise OSError("the disk went away")
            return 0

        monkeypatch.setattr(state.image_store, "purge_expired", flaky)
        monkeypatch.setattr(server.app, "PURGE_INTERVAL_S", 0.01)
        with caplog.at_level(logging.ERROR):
            loop = asyncio.create_task(purge_forever(state))
            await until(lambda: calls >= 3, "the cleanup ran three times")
            loop.cancel()
    assert calls >= 3, "the cleanup loop died at its first error"
    assert "cleanup of expired files failed" in caplog.text


def test_what_expires_is_removed_within_a_quarter_of_its_life(tmp_path: Path) -> None:
    """The cleanup runs four times per time-to-live (a minute apart at most), so what expires
    is gone within a quarter of its life after, not up to a whole one."""
    assert purge_interval_s(settings_for(tmp_path, video_ttl_s=20)) == 5
    assert purge_interval_s(settings_for(tmp_path, image_url_ttl_s=2, video_ttl_s=20)) == 0.5
    assert purge_interval_s(settings_for(tmp_path)) == 60  # an hour's images, a week's videos


async def test_an_unreadable_job_table_leaves_images_served_and_videos_503(tmp_path: Path) -> None:
    (tmp_path / "videos").mkdir()
    (tmp_path / "videos" / "videos.sqlite3").write_bytes(b"this is not a database" * 100)
    harness = Harness(tmp_path)
    async with harness as client:
        assert (await client.get("/health")).status_code == 200
        response = await client.get("/v1/videos")
        assert response.status_code == 503
        assert (
            "videos.sqlite3" not in response.text or "cannot be read" in response.json()["error"]["message"]
        )


async def test_an_unreachable_job_database_leaves_images_served_and_videos_503_naming_it(
    tmp_path: Path,
) -> None:
    with socket.socket() as held:  # bound, not listening: connections are refused
        held.bind(("127.0.0.1", 0))
        url = f"postgresql://someone:secret@127.0.0.1:{held.getsockname()[1]}/jobs"
        harness = Harness(tmp_path, database_url=url)
        async with harness as client:
            assert (await client.get("/health")).status_code == 200
            response = await client.get("/v1/videos")
    assert response.status_code == 503
    message = response.json()["error"]["message"]
    assert message.startswith("--database-url: cannot use postgresql://someone:***@127.0.0.1")
    assert "secret" not in message
