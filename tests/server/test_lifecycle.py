"""Readiness: the app answers while the model loads, and refuses work until it is ready."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import httpx
import pytest

from engine.core.engine import AsyncEngine
from engine.core.lane_loop import LaneLoops
from engine.executor.thread_executor import ThreadExecutor
from pipelines.base import Pipeline
from server.app import create_app
from tests.server.conftest import ImageFakePipeline, settings_for, wait_ready


async def test_health_is_503_until_the_model_is_loaded(tmp_path: Path) -> None:
    loaded = threading.Event()

    def slow_load() -> Pipeline:
        loaded.wait(timeout=10)
        return ImageFakePipeline()

    settings = settings_for(tmp_path)
    app = create_app(settings, AsyncEngine(ThreadExecutor(slow_load), settings.engine_config()))
    transport = httpx.ASGITransport(app=app)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://localhost") as client,
    ):
        assert (await client.get("/health")).status_code == 503
        response = await client.post("/v1/images/generations", json={"prompt": "a"})
        assert response.status_code == 503 and response.json()["error"]["code"] == "engine_not_ready"
        # Worth retrying: the model is loading.
        assert response.headers["x-should-retry"] == "true" and int(response.headers["retry-after"]) > 0
        loaded.set()
        await wait_ready(client)
        assert (await client.post("/v1/images/generations", json={"prompt": "a"})).status_code == 200


async def test_a_dead_engine_answers_503_at_once_and_health_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pipeline = ImageFakePipeline()
    pipeline.gate = threading.Event()
    settings = settings_for(tmp_path)
    engine = AsyncEngine(ThreadExecutor(lambda: pipeline), settings.engine_config())
    app = create_app(settings, engine)
    transport = httpx.ASGITransport(app=app)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://localhost") as client,
    ):
        await wait_ready(client)
        pending = asyncio.create_task(client.post("/v1/images/generations", json={"prompt": "a"}))
        await asyncio.to_thread(pipeline.started.wait, 5)

        def broken(*_: object) -> None:
            raise RuntimeError("a bug in the loop")

        monkeypatch.setattr(LaneLoops, "_finish", broken)  # the loop dies after this batch
        pipeline.gate.set()
        response = await pending
        assert response.status_code == 503 and response.headers["x-should-retry"] == "true"
        health = await client.get("/health")
        assert health.status_code == 503 and health.json() == {
            "status": "failed",
            "reason": "the engine loop died: RuntimeError: a bug in the loop",
        }
