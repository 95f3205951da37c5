"""`Idempotency-Key` on the image POSTs, in process, on both job stores: a retry gets the
first request's answer (joining it while it runs), and the work runs once."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio

from server import idempotency
from tests.media import png
from tests.polling import until
from tests.server.conftest import ClientFactory, ImageFakePipeline
from tests.server.test_edits_api import URL as EDITS
from tests.server.test_edits_api import FakeEditPipeline, edit_client

KEY = {"Idempotency-Key": "cat-1"}
GENERATIONS = "/v1/images/generations"


@pytest.fixture(params=["sqlite", "postgres"])
def database(request: pytest.FixtureRequest) -> str | None:
    """Every test here runs on both job stores (the keys live there)."""
    return request.getfixturevalue("database_url") if request.param == "postgres" else None


@pytest_asyncio.fixture
async def client(make_client: ClientFactory, database: str | None) -> httpx.AsyncClient:
    return await make_client(database_url=database)


def watch_joins(monkeypatch: pytest.MonkeyPatch) -> asyncio.Event:
    """Set once a request finds its key's first use still without an answer (it then waits
    for it): the job store seen through a proxy that notices that claim."""
    waiting = asyncio.Event()
    first_use = idempotency._first_use

    class Watched:
        def __init__(self, store: Any) -> None:
            self._store = store

        def __getattr__(self, name: str) -> Any:
            return getattr(self._store, name)

        async def claim_key(self, *args: Any) -> Any:
            record = await self._store.claim_key(*args)
            if record is not None and record.response is None and record.video_id is None:
                waiting.set()
            return record

    async def watched(store: Any, *args: Any, **kwargs: Any) -> Any:
        proxy: Any = Watched(store)  # a stand-in for the AsyncJobStore it wraps
        return await first_use(proxy, *args, **kwargs)

    monkeypatch.setattr(idempotency, "_first_use", watched)
    return waiting


def runs(pipeline: ImageFakePipeline) -> int:
    return sum(len(batch) for batch in pipeline.forwards)


@pytest.mark.parametrize("response_format", ["b64_json", "url"])
async def test_a_retry_joins_the_first_and_gets_its_answer(
    client: httpx.AsyncClient,
    pipeline: ImageFakePipeline,
    response_format: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    body = {"prompt": "a cat", "size": "64x64", "response_format": response_format}
    waiting = watch_joins(monkeypatch)
    pipeline.gate = threading.Event()  # hold the first while its retry arrives
    first = asyncio.create_task(client.post(GENERATIONS, json=body, headers=KEY))
    await until(pipeline.started.is_set, "the first request's forward")
    joined = asyncio.create_task(client.post(GENERATIONS, json=body, headers=KEY))
    await until(waiting.is_set, "the retry waiting on the first's answer")
    pipeline.gate.set()
    answers = [await first, await joined]
    later = await client.post(GENERATIONS, json=body, headers=KEY)
    assert [a.status_code for a in (*answers, later)] == [200, 200, 200]
    assert answers[0].content == answers[1].content == later.content  # the same images (or URLs)
    assert runs(pipeline) == 1
    # Without a key, the same body runs again.
    assert (await client.post(GENERATIONS, json=body)).status_code == 200
    assert runs(pipeline) == 2


async def test_the_key_with_another_body_is_a_409_naming_the_header(
    client: httpx.AsyncClient, pipeline: ImageFakePipeline
) -> None:
    assert (await client.post(GENERATIONS, json={"prompt": "a"}, headers=KEY)).status_code == 200
    reused = await client.post(GENERATIONS, json={"prompt": "b"}, headers=KEY)
    assert reused.status_code == 409 and reused.headers["x-should-retry"] == "false"
    error = reused.json()["error"]
    assert error["param"] == "Idempotency-Key" and error["code"] == "idempotency_key_reused"
    # Another caller (API key) has keys of its own.
    theirs = await client.post(
        GENERATIONS, json={"prompt": "b"}, headers={**KEY, "Authorization": "Bearer other"}
    )
    assert theirs.status_code == 200 and runs(pipeline) == 2


@pytest.mark.parametrize("changed", [{"timeout": 30}, {"user": "u2"}, {"response_format": "url"}])
async def test_the_key_with_a_body_changed_only_where_the_cache_looks_away_is_a_409(
    make_client: ClientFactory, database: str | None, pipeline: ImageFakePipeline, changed: dict[str, Any]
) -> None:
    # The result cache ignores these fields (its entry would serve both bodies), but the key's
    # claim keeps the whole body's digest: another body with the same key is refused, not
    # answered from the cache.
    client = await make_client(database_url=database, result_cache_mb=16)
    body = {"prompt": "a", "seed": 3, "user": "u1"}
    assert (await client.post(GENERATIONS, json=body, headers=KEY)).status_code == 200
    reused = await client.post(GENERATIONS, json={**body, **changed}, headers=KEY)
    assert reused.status_code == 409, reused.text
    assert reused.json()["error"]["param"] == "Idempotency-Key"
    # Without the key, the same change is a hit.
    assert (await client.post(GENERATIONS, json={**body, **changed})).status_code == 200
    assert runs(pipeline) == 1


async def test_an_answer_too_large_to_keep_is_a_409_on_retry_not_a_second_run(
    client: httpx.AsyncClient, pipeline: ImageFakePipeline, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(idempotency, "MAX_KEPT_RESPONSE_CHARS", 100)
    body = {"prompt": "a", "response_format": "b64_json"}
    assert (await client.post(GENERATIONS, json=body, headers=KEY)).status_code == 200
    retry = await client.post(GENERATIONS, json=body, headers=KEY)
    assert retry.status_code == 409 and retry.headers["x-should-retry"] == "false"
    error = retry.json()["error"]
    assert error["param"] == "Idempotency-Key" and error["code"] == "idempotency_response_not_kept"
    assert "response_format=url" in error["message"] and runs(pipeline) == 1


async def test_a_failed_first_leaves_the_key_free_and_streams_refuse_it(
    client: httpx.AsyncClient, pipeline: ImageFakePipeline
) -> None:
    failed = await client.post(GENERATIONS, json={"prompt": "FAIL"}, headers=KEY)
    assert failed.status_code >= 400
    assert (
        await client.post(GENERATIONS, json={"prompt": "FAIL"}, headers=KEY)
    ).status_code == failed.status_code
    assert runs(pipeline) == 2  # nothing was answered, so the retry ran
    streamed = await client.post(
        GENERATIONS, json={"prompt": "a", "stream": True}, headers={"Idempotency-Key": "s"}
    )
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "Idempotency-Key"
    assert "stream" in streamed.json()["error"]["message"] and runs(pipeline) == 2


@pytest_asyncio.fixture
async def edits(
    tmp_path: Path, database: str | None
) -> AsyncIterator[tuple[httpx.AsyncClient, FakeEditPipeline]]:
    pipeline = FakeEditPipeline()
    client, lifespan = await edit_client(tmp_path, pipeline, database_url=database)
    yield client, pipeline
    await client.aclose()
    await lifespan.__aexit__(None, None, None)  # type: ignore[attr-defined]


async def test_an_edit_retried_with_its_key_runs_once(
    edits: tuple[httpx.AsyncClient, FakeEditPipeline],
) -> None:
    client, pipeline = edits

    def form(image: bytes) -> dict[str, Any]:  # a new multipart boundary on every post
        return {"files": {"image": ("a.png", image, "image/png")}, "data": {"prompt": "make it red"}}

    first = await client.post(EDITS, headers=KEY, **form(png(16, 16)))
    again = await client.post(EDITS, headers=KEY, **form(png(16, 16)))
    assert first.status_code == again.status_code == 200 and first.content == again.content
    assert runs(pipeline) == 1
    other = await client.post(EDITS, headers=KEY, **form(png(16, 16, colour=(0, 0, 255))))
    assert other.status_code == 409 and other.json()["error"]["param"] == "Idempotency-Key"
