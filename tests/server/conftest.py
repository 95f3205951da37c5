"""In-process app fixtures: the real FastAPI app and engine over a fake image pipeline."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest_asyncio

from engine.core.engine import AsyncEngine
from engine.executor.thread_executor import ThreadExecutor
from engine.request import GenerationRequest, RequestBatch, RequestOutput, SamplingParams
from server.app import create_app
from server.settings import ServeSettings
from tests.engine.fakes import FakePipeline


class ImageFakePipeline(FakePipeline):
    """Solid-colour images of the asked size, the colour taken from the seed."""

    def resolve(self, request: GenerationRequest) -> SamplingParams:
        params = request.params
        return replace(
            params,
            width=params.width or 64,
            height=params.height or 64,
            num_inference_steps=params.num_inference_steps or 4,
            guidance_scale=params.guidance_scale or 7.5,
        )

    def forward(self, batch: RequestBatch) -> list[RequestOutput]:
        outputs = super().forward(batch)
        return [
            RequestOutput(
                request_id=o.request_id,
                images=tuple(self._image(r.params, seed) for seed in o.seeds),
                seeds=o.seeds,
            )
            for r, o in zip(batch.requests, outputs, strict=True)
        ]

    @staticmethod
    def _image(params: SamplingParams, seed: int) -> np.ndarray:
        assert params.width and params.height
        image = np.zeros((params.height, params.width, 3), dtype=np.uint8)
        image[...] = (seed % 256, (seed // 256) % 256, 7)
        return image


async def wait_ready(client: httpx.AsyncClient) -> None:
    for _ in range(200):
        if (await client.get("/health")).status_code == 200:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the app never became ready")


@pytest_asyncio.fixture
async def pipeline() -> ImageFakePipeline:
    return ImageFakePipeline()


def settings_for(tmp_path: Path, **values: object) -> ServeSettings:
    return ServeSettings(output_dir=tmp_path, served_model_name="test-model", **values)  # type: ignore[arg-type]


ClientFactory = Callable[..., Awaitable[httpx.AsyncClient]]


@pytest_asyncio.fixture
async def make_client(tmp_path: Path, pipeline: ImageFakePipeline) -> AsyncIterator[ClientFactory]:
    """A factory: `await make_client(**settings)` gives a ready client of a fresh app."""
    stack: list[tuple[AbstractAsyncContextManager[Any], httpx.AsyncClient]] = []

    async def make(**values: object) -> httpx.AsyncClient:
        settings = settings_for(tmp_path, **values)
        engine = AsyncEngine(ThreadExecutor(lambda: pipeline), settings.engine_config())
        app = create_app(settings, engine)
        lifespan = app.router.lifespan_context(app)
        await lifespan.__aenter__()
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost")
        stack.append((lifespan, client))
        await wait_ready(client)
        return client

    yield make
    for lifespan, client in reversed(stack):
        await client.aclose()
        await lifespan.__aexit__(None, None, None)
