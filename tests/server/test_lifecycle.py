"""Readiness: the app answers while the model loads, and refuses work until it is ready."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx

from engine.engine import AsyncEngine
from engine.executor import ThreadExecutor
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
