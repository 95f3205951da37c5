"""A server of several models while its preloads run: `/health` is 503 until they are done,
and `/metrics` already shows each model's state (the metrics are bound before the loads)."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from pathlib import Path

import httpx

from engine.core.engine import AsyncEngine
from engine.executor.thread_executor import ThreadExecutor
from engine.models.model_set import ModelSet, ModelSlot
from engine.worker.pipeline import LoadReport
from pipelines.base import Pipeline
from server.app import create_app
from server.settings import ServeSettings
from tests.polling import until
from tests.server.conftest import ImageFakePipeline, settings_for, wait_ready


async def test_health_waits_for_the_preloads_and_metrics_show_them_loading(tmp_path: Path) -> None:
    loaded = threading.Event()

    def slow_load() -> Pipeline:
        loaded.wait(timeout=30)
        return ImageFakePipeline()

    settings = settings_for(tmp_path, models=["a=x", "b=y"])

    def make(own: ServeSettings) -> AsyncEngine:
        return AsyncEngine(ThreadExecutor(slow_load), own.engine_config())

    slots = [ModelSlot(name, functools.partial(make, settings), preload=True) for name in ("a", "b")]
    app = create_app(settings, ModelSet(slots))
    transport = httpx.ASGITransport(app=app)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://localhost") as client,
    ):

        async def loading_in_metrics() -> bool:
            text = (await client.get("/metrics")).text
            return 'diffbatch_model_state{model="a",state="loading"} 1.0' in text

        await until(loading_in_metrics, "the preloads show in /metrics while they run")
        assert (await client.get("/health")).status_code == 503
        loaded.set()
        await wait_ready(client)
        assert (await client.get("/health")).json()["models"]["b"]["state"] == "loaded"


async def test_a_result_cache_hit_does_not_load_its_model(tmp_path: Path) -> None:
    """With room for one of two models: a repeat of a's request after b took the room is
    answered from the result cache, and a stays unloaded (no load, no eviction of b)."""
    settings = settings_for(tmp_path, models=["a=x", "b=y"], result_cache_mb=16)

    def make(own: ServeSettings) -> AsyncEngine:
        executor = ThreadExecutor(ImageFakePipeline, measure=lambda _: LoadReport(weight_bytes=6 * 2**20))
        return AsyncEngine(executor, own.engine_config())

    slots = [ModelSlot(name, functools.partial(make, settings)) for name in ("a", "b")]
    models = ModelSet(slots, budget_bytes=10 * 2**20)
    app = create_app(settings, models)
    transport = httpx.ASGITransport(app=app)
    body = {"model": "a", "prompt": "a cat", "size": "64x64", "seed": 7}
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://localhost") as client,
    ):
        await wait_ready(client)
        first = await client.post("/v1/images/generations", json=body)
        assert (await client.post("/v1/images/generations", json={**body, "model": "b"})).status_code == 200
        assert models.slots["a"].state == "unloaded"
        again = await client.post("/v1/images/generations", json=body)
        assert again.status_code == 200 and again.json()["data"] == first.json()["data"]
        assert models.slots["a"].loads == 1 and models.slots["a"].state == "unloaded"
        assert models.slots["b"].state == "loaded"


async def test_health_says_why_a_model_failed_only_to_a_caller_the_key_check_admits(tmp_path: Path) -> None:
    """`/health` is open: without a key it names a failed model's state, not its exception
    text or paths (those go to the log, and to a caller with a key); a server without keys
    admits everyone, to /health as to every route."""

    def broken() -> Pipeline:
        raise OSError("/srv/secret/models/broken/unet: no such directory")

    for keys, headers, shown in (
        ("k1", {}, False),
        ("k1", {"Authorization": "Bearer wrong"}, False),
        ("k1", {"Authorization": "Bearer k1"}, True),
        (None, {}, True),
    ):
        settings = settings_for(tmp_path / str(shown) / str(keys), models=["ok=x", "broken=y"], api_key=keys)

        def make(own: ServeSettings, load: Callable[[], Pipeline]) -> AsyncEngine:
            return AsyncEngine(ThreadExecutor(load), own.engine_config())

        slots = [
            ModelSlot("ok", functools.partial(make, settings, ImageFakePipeline), preload=True),
            ModelSlot("broken", functools.partial(make, settings, broken), preload=True),
        ]
        app = create_app(settings, ModelSet(slots))
        transport = httpx.ASGITransport(app=app)
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(transport=transport, base_url="http://localhost", headers=headers) as client,
        ):
            await wait_ready(client)
            broken_model = (await client.get("/health")).json()["models"]["broken"]
        assert broken_model["state"] == "failed"
        assert ("/srv/secret" in broken_model["reason"]) is shown, (keys, headers, broken_model)
        if not shown:
            assert "OSError" not in broken_model["reason"] and "server log" in broken_model["reason"]
