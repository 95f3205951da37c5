"""A server whose job store others share: jobs ended elsewhere stop here, lapsed leases
fail, and a database in trouble is a 503 that neither stops the engine nor loses the job.
In process, on both stores."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest

from server.jobs.model import JobStoreUnavailableError
from server.videos.service import VideoService
from tests.polling import until
from tests.server.test_videos_api import Harness, job_database, poll

__all__ = ["job_database"]  # the fixture that runs each test on both stores


async def test_a_running_job_deleted_by_another_server_is_cancelled_at_the_next_renewal(
    tmp_path: Path,
) -> None:
    harness = Harness(tmp_path)
    async with harness as client:
        gate = harness.pipeline.gate = threading.Event()
        job = (await client.post("/v1/videos", json={"prompt": "a", "seconds": 1})).json()
        await asyncio.to_thread(harness.pipeline.started.wait, 5)
        service: VideoService = harness.app.state.diffbatch.videos
        assert await service.store.delete(job["id"])  # as another server's DELETE does: the row only
        await service._leases.renew_once()
        engine = harness.app.state.diffbatch.engine
        await until(lambda: engine.stats.requests_aborted == 1, "the job's request is aborted here")
        gate.set()
        await until(lambda: not service.in_use(), "the job is forgotten")
        assert list((tmp_path / "videos").glob(f"{job['id']}*")) == []


async def test_a_database_hiccup_while_a_job_runs_neither_stops_the_engine_nor_the_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    harness = Harness(tmp_path)
    async with harness as client:
        service: VideoService = harness.app.state.diffbatch.videos

        def unreachable(*_: Any, **__: Any) -> None:
            raise JobStoreUnavailableError("the job database cannot be reached: connection refused")

        with monkeypatch.context() as patch:
            patch.setattr(service.store._store, "mark_running", unreachable)
            patch.setattr(service.store._store, "set_progress", unreachable)
            first = (await client.post("/v1/videos", json={"prompt": "a", "seconds": 1})).json()
            engine = harness.app.state.diffbatch.engine
            await until(lambda: engine.stats.requests_finished >= 1, "the job ran")
        assert (await poll(client, first["id"], {"completed", "failed"}))["status"] == "completed"
        second = (await client.post("/v1/videos", json={"prompt": "b", "seconds": 1})).json()
        assert (await poll(client, second["id"], {"completed", "failed"}))["status"] == "completed"


async def test_an_unreachable_database_is_a_503_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    harness = Harness(tmp_path)
    async with harness as client:
        service: VideoService = harness.app.state.diffbatch.videos

        async def unreachable(*_: Any, **__: Any) -> None:
            raise JobStoreUnavailableError("the job database cannot be reached: connection refused")

        monkeypatch.setattr(service.store, "get", unreachable)
        response = await client.get("/v1/videos/video_x")
        assert response.status_code == 503 and response.headers["x-should-retry"] == "true"
        error = response.json()["error"]
        assert error["code"] == "job_store_unavailable" and "cannot be reached" in error["message"]
