"""First-Block Cache through a real `diffbatch serve tiny-flux --cache first-block` (step
mode; and tiny-z-image) with the official client: the server's cache for requests that choose none, a
request's own threshold, a request that turns it off, sent together; each image is the one
its request makes alone; the skipped blocks show in `/metrics`; a bad mode is a 400."""

from __future__ import annotations

import base64
import io
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
from PIL import Image

from bench.launch import start_server, stop_server
from engine.request import CacheChoice, GenerationRequest, SamplingParams
from pipelines.base import PipelineConfig
from pipelines.registry import load_pipeline
from tests.e2e.conftest import Server
from tests.e2e.sharing import sent_together

pytestmark = pytest.mark.slow

# The server's --cache-threshold per model: one its first block's step-to-step change (at 32x32,
# 8 steps) falls under on some steps. Z-Image's text-guided tiny model changes by 0.73-0.96.
SERVER_THRESHOLDS = {"tiny-flux": 0.7, "tiny-z-image": 0.85}


def bodies(server_threshold: float) -> list[tuple[dict[str, Any], CacheChoice]]:
    """(extra body, the cache it runs with) of requests sent to a server of `server_threshold`."""
    server_cache = CacheChoice("first-block", server_threshold)
    return [
        ({"seed": 1}, server_cache),
        ({"seed": 2, "cache": {"mode": "first-block", "threshold": 0.45}}, CacheChoice("first-block", 0.45)),
        ({"seed": 3, "cache": {"mode": "none"}}, CacheChoice("none", 0.1)),
        # No threshold of its own: the server's --cache-threshold.
        ({"seed": 4, "cache": {"mode": "first-block"}}, server_cache),
    ]


def generate(client: openai.OpenAI, body: dict[str, Any]) -> np.ndarray:
    result = client.images.generate(prompt="a red circle", size="32x32", extra_body=body)
    assert result.data is not None
    return pixels(result.data[0].b64_json)


def served_together(
    server: Server, client: openai.OpenAI, bodies: list[tuple[dict[str, Any], CacheChoice]]
) -> list[np.ndarray]:
    """Each body's image, all sent at once, once some of them shared a denoiser forward."""

    def send() -> list[np.ndarray]:
        with ThreadPoolExecutor(len(bodies)) as pool:
            return list(pool.map(lambda body: generate(client, body), [body for body, _ in bodies]))

    return sent_together(server, send)


def pixels(b64: str | None) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64 or ""))).convert("RGB"))


# FLUX, and Z-Image (a new family: its rows pad their captions to the group's longest).
@pytest.mark.parametrize("model", sorted(SERVER_THRESHOLDS))
def test_cached_requests_served_together_each_match_alone(tmp_path: Path, model: str) -> None:
    threshold = SERVER_THRESHOLDS[model]
    sent = bodies(threshold)
    flags = ("--cache", "first-block", "--cache-threshold", str(threshold))
    server = start_server(tmp_path, model, *flags, config=None)
    try:
        with openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0) as client:
            served = served_together(server, client, sent)
            with pytest.raises(openai.BadRequestError) as refused:
                generate(client, {"cache": {"mode": "teacache"}})
            assert refused.value.body["param"] == "cache.mode"  # type: ignore[index]
        assert server.metric("diffbatch_cache_blocks_skipped_total") > 0
    finally:
        stop_server(server)

    assert_each_matches_alone(sent, served, model)


def assert_each_matches_alone(
    bodies: list[tuple[dict[str, Any], CacheChoice]], served: list[np.ndarray], model: str = "tiny-flux"
) -> None:
    """Each served image is within 1/255 of its request's run alone, in process."""
    pipeline = load_pipeline(PipelineConfig(model=model, num_threads=1))
    for (body, choice), got in zip(bodies, served, strict=True):
        params = SamplingParams(width=32, height=32, seed=body["seed"], cache=choice)
        request = GenerationRequest.create("a red circle", params)
        (state,) = pipeline.prepare([request.with_params(pipeline.resolve(request))])
        while not state.is_done:
            pipeline.step([state])
        (alone,) = pipeline.finish([state])
        assert np.abs(got.astype(int) - alone.images[0].astype(int)).max() <= 1
