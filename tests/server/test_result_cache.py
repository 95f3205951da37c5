"""The result cache (`--result-cache-mb`): an exact repeat of an image request with a seed is
answered from it without a forward; never a request without a seed, a streamed one, or one
that differs in a field that changes the images; counted in /metrics."""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from server.result_cache import CachedImages, ResultCache
from tests.media import picture
from tests.server.conftest import ClientFactory, ImageFakePipeline
from tests.server.test_edits_api import URL as EDITS
from tests.server.test_edits_api import FakeEditPipeline, edit_client

BODY: dict[str, Any] = {"prompt": "a cat", "size": "64x64", "seed": 7, "n": 2}


async def test_an_exact_repeat_with_a_seed_is_answered_without_a_forward(
    make_client: ClientFactory, pipeline: ImageFakePipeline
) -> None:
    client = await make_client(result_cache_mb=16)
    first = (await client.post("/v1/images/generations", json=BODY)).json()
    again = (await client.post("/v1/images/generations", json=BODY)).json()
    assert len(pipeline.forwards) == 1
    assert again["data"] == first["data"] and len(again["data"]) == 2
    assert again["size"] == "64x64"
    for changed in ({"seed": 8}, {"prompt": "a dog"}, {"n": 1}, {"output_format": "jpeg"}, {"size": "32x32"}):
        await client.post("/v1/images/generations", json={**BODY, **changed})
    assert len(pipeline.forwards) == 6
    metrics = (await client.get("/metrics")).text
    assert "diffbatch_result_cache_hits_total 1.0" in metrics
    assert "diffbatch_result_cache_misses_total 6.0" in metrics
    assert "diffbatch_result_cache_entries 6.0" in metrics


async def test_a_repeat_differing_only_in_how_it_is_served_is_a_hit(
    make_client: ClientFactory, pipeline: ImageFakePipeline
) -> None:
    # Deadline, priority, sender and delivery change no pixel: each of these is answered from
    # the first's entry, `url` ones with the very images the first got as base64.
    client = await make_client(result_cache_mb=16)
    first = (await client.post("/v1/images/generations", json={**BODY, "quality": "high"})).json()
    served: list[dict[str, Any]] = [
        {"timeout": 30},
        {"priority": 3},
        {"user": "someone", "safety_identifier": "x"},
        {"quality": "hd"},
        {"response_format": "url"},
    ]
    for changed in served:
        response = await client.post("/v1/images/generations", json={**BODY, "quality": "high", **changed})
        assert response.status_code == 200, response.text
    assert len(pipeline.forwards) == 1
    url = response.json()["data"][0]["url"]
    image = await client.get(url.removeprefix("http://localhost"))
    assert image.content == base64.b64decode(first["data"][0]["b64_json"])
    await client.post("/v1/images/generations", json={**BODY, "quality": "low"})  # fewer steps
    assert len(pipeline.forwards) == 2


@pytest.mark.parametrize(("scope", "forwards"), [("tenant", 2), ("global", 1)])
async def test_one_keys_entry_answers_another_key_only_with_a_global_scope(
    make_client: ClientFactory, pipeline: ImageFakePipeline, scope: str, forwards: int
) -> None:
    # Per key by default: a hit is fast, so a shared entry would tell bob that alice already
    # ran this exact prompt and seed (issue 39).
    client = await make_client(result_cache_mb=16, result_cache_scope=scope, api_key="alice, bob")
    for key in ("alice", "alice", "bob", "bob"):
        response = await client.post(
            "/v1/images/generations", json=BODY, headers={"Authorization": f"Bearer {key}"}
        )
        assert response.status_code == 200, response.text
    assert len(pipeline.forwards) == forwards


@pytest.mark.parametrize("extra", [{"seed": None}, {"stream": True}])
async def test_no_hit_without_a_seed_nor_for_a_stream(
    make_client: ClientFactory, pipeline: ImageFakePipeline, extra: dict[str, Any]
) -> None:
    client = await make_client(result_cache_mb=16)
    body = {key: value for key, value in {**BODY, **extra}.items() if value is not None}
    for _ in range(2):
        response = await client.post("/v1/images/generations", json=body)
        assert response.status_code == 200
        await response.aread()
    assert len(pipeline.forwards) == 2
    assert "diffbatch_result_cache_hits_total 0.0" in (await client.get("/metrics")).text


async def test_off_by_default(make_client: ClientFactory, pipeline: ImageFakePipeline) -> None:
    client = await make_client()
    for _ in range(2):
        await client.post("/v1/images/generations", json=BODY)
    assert len(pipeline.forwards) == 2
    assert "diffbatch_result_cache" not in (await client.get("/metrics")).text


async def test_the_cache_stays_within_its_bytes_least_recently_used_out() -> None:
    cache = ResultCache(10)
    entry = CachedImages((b"12345",), (1,), "1x1")
    await cache.put("a", entry)
    await cache.put("b", entry)
    assert await cache.get("a") is entry  # a is now the most recently used
    await cache.put("c", entry)  # evicts b
    assert await cache.get("b") is None and await cache.get("c") is entry
    await cache.put("huge", CachedImages((b"x" * 11,), (1,), "1x1"))  # larger than the cache: not kept
    assert await cache.get("huge") is None and cache.nbytes == 10 and cache.evictions == 1


class PromptCachedPipeline(ImageFakePipeline):
    """Reports prompt-cache counts as a pipeline with a prompt cache does."""

    def prompt_cache_counts(self) -> dict[str, float]:
        counts = {"hits": 7.0, "misses": 1.0, "evictions": 0.0, "encode_seconds": 0.5}
        return {**counts, "bytes": 1024.0, "entries": 1.0}


@pytest.mark.parametrize("pipeline", [PromptCachedPipeline()])
async def test_the_workers_prompt_cache_counts_reach_metrics(make_client: ClientFactory) -> None:
    client = await make_client()
    assert "diffbatch_prompt_cache" not in (await client.get("/metrics")).text  # no result yet
    await client.post("/v1/images/generations", json=BODY)
    metrics = (await client.get("/metrics")).text
    for line in (
        "diffbatch_prompt_cache_hits_total 7.0",
        "diffbatch_prompt_cache_misses_total 1.0",
        "diffbatch_prompt_cache_encode_seconds_total 0.5",
        "diffbatch_prompt_cache_bytes 1024.0",
        "diffbatch_prompt_cache_entries 1.0",
    ):
        assert line in metrics


async def test_uploads_with_the_same_bytes_in_another_shape_are_not_the_same_edit(tmp_path: Path) -> None:
    # 8x4 and 4x8 pictures of the same bytes: a digest of the bytes alone would answer the
    # second from the first's entry (and a retry of one with the other's Idempotency-Key).
    wide = picture(8, 4, seed=3)
    tall = wide.reshape(8, 4, 3)
    pipeline = FakeEditPipeline()
    client, lifespan = await edit_client(tmp_path, pipeline, result_cache_mb=16)
    try:
        for pixels in (wide, tall, wide):
            response = await client.post(
                EDITS,
                data={"prompt": "p", "seed": "1"},
                files={"image": ("a.png", encode(pixels), "image/png")},
            )
            assert response.status_code == 200, response.text
    finally:
        await client.aclose()
        await lifespan.__aexit__(None, None, None)  # type: ignore[attr-defined]
    assert len(pipeline.forwards) == 2  # the third, a repeat of the first, is a hit


def encode(pixels: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()
