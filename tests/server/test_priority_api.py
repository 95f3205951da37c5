"""Scheduling priority over HTTP, in process: the `priority` field and the API key's default
reach the engine, and a better priority queued later runs first."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from engine.request import RequestBatch, RequestOutput
from server.settings import SettingsError, load_settings
from tests.media import png
from tests.polling import until
from tests.server.conftest import ClientFactory, ImageFakePipeline
from tests.server.test_edits_api import FakeEditPipeline, edit_client
from tests.server.test_images_api import assert_error, queued

URL = "/v1/images/generations"


class RecordingPipeline(ImageFakePipeline):
    """Records each forward's (prompt, priority) pairs, in the order forwards run."""

    def __init__(self) -> None:
        super().__init__()
        self.ran: list[tuple[str, int]] = []

    def forward(self, batch: RequestBatch) -> list[RequestOutput]:
        self.ran.extend((r.prompt, r.params.priority) for r in batch.requests)
        return super().forward(batch)


@pytest.fixture
def pipeline() -> RecordingPipeline:
    return RecordingPipeline()


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_a_better_priority_queued_later_runs_first(
    make_client: ClientFactory, pipeline: RecordingPipeline
) -> None:
    pipeline.gate = threading.Event()
    client = await make_client(max_num_seqs=1)
    try:
        blocker = asyncio.create_task(client.post(URL, json={"prompt": "blocker"}))
        await asyncio.to_thread(pipeline.started.wait, 5)
        low = asyncio.create_task(client.post(URL, json={"prompt": "low", "priority": 10}))
        await until(lambda: queued(client, 1), "the low-priority request waits")
        high = asyncio.create_task(client.post(URL, json={"prompt": "high", "priority": -5}))
        await until(lambda: queued(client, 2), "the high-priority request waits behind it")
    finally:
        pipeline.gate.set()
    for task in (blocker, low, high):
        assert (await task).status_code == 200
    assert pipeline.ran == [("blocker", 0), ("high", -5), ("low", 10)]


async def test_an_api_keys_priority_applies_when_a_request_sets_none(
    make_client: ClientFactory, pipeline: RecordingPipeline
) -> None:
    client = await make_client(api_key="batch:priority=10, live")
    for prompt, key, body in [
        ("batch-default", "batch", {}),
        ("batch-asks-worse", "batch", {"priority": 12}),
        ("live-default", "live", {}),
    ]:
        response = await client.post(URL, json={"prompt": prompt, **body}, headers=auth(key))
        assert response.status_code == 200, response.text
    assert pipeline.ran == [("batch-default", 10), ("batch-asks-worse", 12), ("live-default", 0)]


async def test_a_keys_priority_is_the_best_its_requests_may_ask_for(
    make_client: ClientFactory, pipeline: RecordingPipeline, tmp_path: Path
) -> None:
    # Else a key at 10 asking -1000 runs before every other key's work (issue 39).
    client = await make_client(api_key="batch:priority=10, live")
    for key, own, asked in [("batch", 10, 9), ("batch", 10, -1000), ("live", 0, -1)]:
        refused = await client.post(URL, json={"prompt": "x", "priority": asked}, headers=auth(key))
        assert_error(refused, 400, param="priority")
        assert f"run at priority {own} or a worse" in refused.json()["error"]["message"]
        video = await client.post(
            "/v1/videos", data={"prompt": "x", "priority": str(asked)}, headers=auth(key)
        )
        assert_error(video, 400, param="priority")
    assert pipeline.ran == []
    edits, lifespan = await edit_client(tmp_path / "edits", FakeEditPipeline(), api_key="batch:priority=10")
    try:
        image = {"image": ("a.png", png(40, 30), "image/png")}
        bad = await edits.post(
            "/v1/images/edits", data={"prompt": "x", "priority": "3"}, files=image, headers=auth("batch")
        )
        assert_error(bad, 400, param="priority")
    finally:
        await edits.aclose()
        await lifespan.__aexit__(None, None, None)  # type: ignore[attr-defined]


@pytest.mark.parametrize("priority", [1001, -1001, 1.5, "high"])
async def test_a_priority_out_of_range_is_400_naming_it(make_client: ClientFactory, priority: object) -> None:
    client = await make_client()
    assert_error(await client.post(URL, json={"prompt": "x", "priority": priority}), 400, param="priority")
    video = await client.post("/v1/videos", data={"prompt": "x", "priority": str(priority)})
    assert_error(video, 400, param="priority")


async def test_an_edits_form_field_priority_reaches_the_engine(tmp_path: Path) -> None:
    class RecordingEdits(FakeEditPipeline):
        def __init__(self) -> None:
            super().__init__()
            self.priorities: list[int] = []

        def forward(self, batch: RequestBatch) -> list[RequestOutput]:
            self.priorities.extend(r.params.priority for r in batch.requests)
            return super().forward(batch)

    pipeline = RecordingEdits()
    client, lifespan = await edit_client(tmp_path, pipeline)
    try:
        image = {"image": ("a.png", png(40, 30), "image/png")}
        response = await client.post("/v1/images/edits", data={"prompt": "x", "priority": "7"}, files=image)
        assert response.status_code == 200, response.text
        bad = await client.post("/v1/images/edits", data={"prompt": "x", "priority": "2000"}, files=image)
        assert_error(bad, 400, param="priority")
    finally:
        await client.aclose()
        await lifespan.__aexit__(None, None, None)  # type: ignore[attr-defined]
    assert pipeline.priorities == [7]


def test_unknown_api_key_settings_stop_start_up_naming_them() -> None:
    with pytest.raises(SettingsError, match="unknown setting 'colour'") as caught:
        load_settings(None, {"api_key": "sekrit:colour=3"})
    assert "sekrit" not in str(caught.value)  # a key is never echoed
    with pytest.raises(SettingsError, match="priority must be from -1000 to 1000"):
        load_settings(None, {"api_key": "a, b:priority=5000"})
    with pytest.raises(SettingsError, match="priority_aging_s"):
        load_settings(None, {"priority_aging_s": 0})
    keys = load_settings(None, {"api_key": "old:colon, new:priority=-3"}).api_key_entries
    assert [(k.key, k.priority) for k in keys] == [("old:colon", 0), ("new", -3)]


def test_a_keys_file_holds_one_key_a_line(tmp_path: Path) -> None:
    secret = tmp_path / "keys"
    secret.write_text("live\nbatch:priority=10\n")
    settings = load_settings(None, {"api_key_file": secret})
    assert [(k.key, k.priority) for k in settings.api_key_entries] == [("live", 0), ("batch", 10)]
    assert settings.api_keys == ("live", "batch")
