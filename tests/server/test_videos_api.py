"""The Videos API in process, over a fake video pipeline: jobs, files, restarts — with the
job rows in SQLite and, for each test again, in a real PostgreSQL."""

from __future__ import annotations

import asyncio
import base64
import io
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any, ClassVar

import httpx
import numpy as np
import pytest
from PIL import Image

from engine.core.engine import AsyncEngine
from engine.executor.thread_executor import ThreadExecutor
from engine.request import GenerationRequest, InvalidRequestError, RequestBatch, RequestOutput, SamplingParams
from pipelines.base import Modality
from server.app import create_app
from server.videos.encoding import probe_mp4
from server.videos.polling import POLL_MIN_MS
from tests.engine.fakes import FakePipeline
from tests.media import png
from tests.server.conftest import settings_for, wait_ready


class FakeVideoPipeline(FakePipeline):
    modality: ClassVar[Modality] = "video"

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[GenerationRequest] = []  # every request it ran, as admitted

    def resolve(self, request: GenerationRequest) -> SamplingParams:
        params = request.params
        fps = params.fps or 8
        frames = int((params.duration_s or 1) * fps) + 1
        return replace(
            params, width=params.width or 32, height=params.height or 32, fps=fps, num_frames=frames
        )

    def forward(self, batch: RequestBatch) -> list[RequestOutput]:
        self.seen.extend(batch.requests)
        outputs = super().forward(batch)
        videos = []
        for request, output in zip(batch.requests, outputs, strict=True):
            p = request.params
            assert p.num_frames and p.height and p.width
            frames = np.zeros((p.num_frames, p.height, p.width, 3), dtype=np.uint8)
            frames[:, :, :, 0] = np.arange(p.num_frames, dtype=np.uint8)[:, None, None] * 10
            videos.append(RequestOutput(request_id=output.request_id, images=(frames,), seeds=output.seeds))
        return videos


class FakeImageToVideoPipeline(FakeVideoPipeline):
    input_image_count: ClassVar[tuple[int, int]] = (0, 1)

    def reduce_inputs(self, request: GenerationRequest) -> GenerationRequest:
        """Keeps the top-left corner of the video's size, as a model keeps what it uses."""
        if not request.input_images:
            return request
        p = request.params
        assert p.width and p.height
        return replace(request, input_images=(request.input_images[0][: p.height, : p.width].copy(),))


class Harness:
    """A fresh app over one output directory; `restart` builds another on the same one."""

    # The job database of the test running now (the `job_database` fixture), None for SQLite.
    database_url: ClassVar[str | None] = None

    def __init__(self, tmp_path: Path, pipeline: FakeVideoPipeline | None = None, **settings: object) -> None:
        self.tmp_path = tmp_path
        self.pipeline = pipeline or FakeVideoPipeline()
        self.settings = {"database_url": self.database_url, **settings}

    async def __aenter__(self) -> httpx.AsyncClient:
        settings = settings_for(self.tmp_path, **self.settings)
        engine = AsyncEngine(ThreadExecutor(lambda: self.pipeline), settings.engine_config())
        self.app = create_app(settings, engine)
        self.lifespan = self.app.router.lifespan_context(self.app)
        await self.lifespan.__aenter__()
        self.client = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=self.app), base_url="http://localhost"
        )
        await wait_ready(self.client)
        return self.client

    async def __aexit__(self, *exc: object) -> None:
        await self.client.aclose()
        await self.lifespan.__aexit__(None, None, None)


@pytest.fixture(autouse=True, params=["sqlite", "postgres"])
def job_database(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test here runs on both job stores."""
    if request.param == "postgres":
        monkeypatch.setattr(Harness, "database_url", request.getfixturevalue("database_url"))
    kind: str = request.param
    return kind


async def poll(
    client: httpx.AsyncClient, video_id: str, until: set[str], headers: dict[str, str] | None = None
) -> dict[str, Any]:
    for _ in range(500):
        body: dict[str, Any] = (await client.get(f"/v1/videos/{video_id}", headers=headers)).json()
        if body["status"] in until:
            return body
        await asyncio.sleep(0.01)
    raise AssertionError(f"video {video_id} stuck in {body['status']}")


async def test_create_poll_and_download(tmp_path: Path) -> None:
    async with Harness(tmp_path) as client:
        created = (
            await client.post("/v1/videos", json={"prompt": "a boat", "seconds": 2, "size": "48x32"})
        ).json()
        assert created["object"] == "video" and created["status"] in ("queued", "in_progress")
        assert created["size"] == "48x32" and created["seconds"] == "2"
        done = await poll(client, created["id"], {"completed", "failed"})
        assert done["status"] == "completed" and done["progress"] == 100 and done["expires_at"]
        video = await client.get(f"/v1/videos/{created['id']}/content")
        assert video.headers["content-type"] == "video/mp4"
        assert probe_mp4(video.content) == (17, 48, 32, False)
        thumbnail = await client.get(f"/v1/videos/{created['id']}/content", params={"variant": "thumbnail"})
        assert thumbnail.headers["content-type"] == "image/png"
        sheet = await client.get(f"/v1/videos/{created['id']}/content", params={"variant": "spritesheet"})
        assert sheet.headers["content-type"] == "image/png"
        # 17 frames of 48x32: 16 of them (first and last included) in a 4 x 4 grid.
        assert Image.open(io.BytesIO(sheet.content)).size == (4 * 48, 4 * 32)


async def test_multipart_like_the_official_client(tmp_path: Path) -> None:
    async with Harness(tmp_path) as client:
        response = await client.post("/v1/videos", data={"prompt": "a boat", "seconds": "1", "fps": "4"})
        assert response.status_code == 200, response.text
        # OpenAI's API types seconds as a string: JSON may send it so too.
        as_json = await client.post("/v1/videos", json={"prompt": "a boat", "seconds": "1", "fps": 4})
        assert as_json.status_code == 200, as_json.text
        done = await poll(client, response.json()["id"], {"completed", "failed"})
        assert done["status"] == "completed"
        for content, fragment in ((b"xx", "not an image"), (png(16, 16), "takes no input image")):
            upload = await client.post(
                "/v1/videos",
                data={"prompt": "a boat"},
                files={"input_reference": ("a.png", content, "image/png")},
            )
            error = upload.json()["error"]
            assert upload.status_code == 400 and error["param"] == "input_reference"
            assert fragment in error["message"] and "input image input image" not in error["message"]


async def test_bad_input_fails_the_call_and_queues_nothing(tmp_path: Path) -> None:
    async with Harness(tmp_path) as client:
        for payload, param in (
            ({"prompt": ["a", "b"]}, "prompt"),
            ({"prompt": "a", "seconds": 0}, "seconds"),
            ({"prompt": "a", "size": "huge"}, "size"),
            ({"prompt": "a", "width": 3}, "width"),
            ({"prompt": "a", "model": "sora-2"}, "model"),
            # JSON is taken as typed (a form's strings are converted: the multipart test).
            ({"prompt": "a", "fps": "4"}, "fps"),
            ({"prompt": "a", "seconds": True}, "seconds"),
            ({"prompt": "a", "cache": []}, "cache"),
        ):
            response = await client.post("/v1/videos", json=payload)
            assert response.status_code in (400, 404), response.text
            assert response.json()["error"]["param"] == param
        assert (await client.get("/v1/videos")).json()["data"] == []


async def test_an_unknown_model_is_named_before_any_upload_is_decoded(tmp_path: Path) -> None:
    # The model is checked first: a control video (seconds to decode) or a reference image
    # sent to a model this server does not serve is never decoded; the error names `model`.
    async with Harness(tmp_path) as client:
        form = await client.post(
            "/v1/videos",
            data={"prompt": "a boat", "model": "sora-2"},
            files={"video": ("a.mp4", b"not a video", "video/mp4")},
        )
        as_json = await client.post(
            "/v1/videos", json={"prompt": "a boat", "model": "sora-2", "input_reference": "data:,x"}
        )
        for response in (form, as_json):
            assert response.status_code == 404, response.text
            assert response.json()["error"]["param"] == "model"


async def test_list_pages_in_order(tmp_path: Path) -> None:
    async with Harness(tmp_path) as client:
        ids = [
            (await client.post("/v1/videos", json={"prompt": f"p{i}", "seconds": 1})).json()["id"]
            for i in range(3)
        ]
        first = (await client.get("/v1/videos", params={"limit": 2})).json()
        assert [v["id"] for v in first["data"]] == [ids[2], ids[1]] and first["has_more"] is True
        rest = (await client.get("/v1/videos", params={"limit": 2, "after": first["last_id"]})).json()
        assert [v["id"] for v in rest["data"]] == [ids[0]] and rest["has_more"] is False
        ascending = (await client.get("/v1/videos", params={"order": "asc"})).json()
        assert [v["id"] for v in ascending["data"]] == ids


async def test_deleted_while_queued_never_runs(tmp_path: Path) -> None:
    harness = Harness(tmp_path)
    harness.pipeline.gate = threading.Event()
    async with harness as client:
        try:
            running = (await client.post("/v1/videos", json={"prompt": "first", "seconds": 1})).json()
            await asyncio.to_thread(harness.pipeline.started.wait, 5)
            queued = (await client.post("/v1/videos", json={"prompt": "second", "seconds": 2})).json()
            deleted = (await client.delete(f"/v1/videos/{queued['id']}")).json()
            assert deleted == {"id": queued["id"], "object": "video.deleted", "deleted": True}
            assert (await client.get(f"/v1/videos/{queued['id']}")).status_code == 404
        finally:
            harness.pipeline.gate.set()
        await poll(client, running["id"], {"completed"})
    assert len(harness.pipeline.forwards) == 1  # only the first one ran


async def test_restart_keeps_completed_and_fails_interrupted(tmp_path: Path) -> None:
    harness = Harness(tmp_path)
    async with harness as client:
        done = (await client.post("/v1/videos", json={"prompt": "kept", "seconds": 1})).json()
        await poll(client, done["id"], {"completed"})
        gate = harness.pipeline.gate = threading.Event()
        harness.pipeline.started.clear()
        cut = (await client.post("/v1/videos", json={"prompt": "cut short", "seconds": 1})).json()
        await asyncio.to_thread(harness.pipeline.started.wait, 5)
        assert (await client.get(f"/v1/videos/{cut['id']}")).json()["status"] == "in_progress"
        # The server stops while the job runs; the forward ends only after the stop began.
        threading.Timer(0.3, gate.set).start()
    async with Harness(tmp_path) as client:
        kept = await client.get(f"/v1/videos/{done['id']}/content")
        assert kept.status_code == 200 and probe_mp4(kept.content)[0] == 9
        after = (await client.get(f"/v1/videos/{cut['id']}")).json()
        # Stopped gracefully: failed at the stop, with a reason (a crash leaves it to the restart).
        assert after["status"] == "failed" and after["error"]["code"] == "server_stopped"
        assert (await client.get(f"/v1/videos/{cut['id']}/content")).status_code == 404


async def test_image_endpoint_refuses_a_video_model(tmp_path: Path) -> None:
    async with Harness(tmp_path) as client:
        response = await client.post("/v1/images/generations", json={"prompt": "a"})
        assert response.status_code == 400 and response.json()["error"]["code"] == "unsupported_model"


async def test_input_reference_inline_as_a_data_url_never_as_a_fetched_url(tmp_path: Path) -> None:
    data_url = "data:image/png;base64," + base64.b64encode(png(16, 16)).decode()
    async with Harness(tmp_path) as client:
        cases: list[tuple[dict[str, Any], str]] = [
            # Read, then refused by this text-to-video model: the image got as far as the model.
            ({"json": {"prompt": "a", "input_reference": data_url}}, "takes no input image"),
            ({"json": {"prompt": "a", "input_reference": {"image_url": data_url}}}, "takes no input image"),
            ({"data": {"prompt": "a", "input_reference": data_url}}, "takes no input image"),
            (
                {"json": {"prompt": "a", "input_reference": "https://example.com/a.png"}},
                "does not fetch URLs",
            ),
            ({"json": {"prompt": "a", "input_reference": "data:image/png;base64,%%%"}}, "not valid base64"),
            # As the form's input_reference[file_id] is answered: a file_id needs a Files API.
            ({"json": {"prompt": "a", "input_reference": {"file_id": "file_1"}}}, "no Files API"),
        ]
        for request, fragment in cases:
            response = await client.post("/v1/videos", **request)
            error = response.json()["error"]
            assert response.status_code == 400 and error["param"] == "input_reference", response.text
            assert fragment in error["message"]


async def test_jobs_in_progress_say_when_to_poll_again(tmp_path: Path) -> None:
    harness = Harness(tmp_path)
    harness.pipeline.gate = threading.Event()
    async with harness as client:
        try:
            created = await client.post("/v1/videos", json={"prompt": "a", "seconds": 1})
            assert int(created.headers["openai-poll-after-ms"]) > 0
        finally:
            harness.pipeline.gate.set()
        done = await poll(client, created.json()["id"], {"completed"})
        finished = await client.get(f"/v1/videos/{done['id']}")
        assert "openai-poll-after-ms" not in finished.headers  # nothing left to wait for
        # The server learnt how long this model's videos take, and a new job suggests a quarter
        # of that, so the official client (which keeps its first interval) is not a second late.
        typical_s = harness.app.state.diffbatch.video_service().durations.typical_s(done["model"])
        assert typical_s is not None and typical_s > 0
        again = await client.post("/v1/videos", json={"prompt": "b", "seconds": 1})
        assert int(again.headers["openai-poll-after-ms"]) <= max(POLL_MIN_MS, typical_s * 1000 / 4)


async def test_remix_repeats_the_settings_and_seed_with_a_new_prompt(tmp_path: Path) -> None:
    harness = Harness(tmp_path)
    async with harness as client:
        body = {"prompt": "a boat", "seconds": 2, "size": "48x32", "num_inference_steps": 3, "fps": 4}
        source = (await client.post("/v1/videos", json=body)).json()
        early = await client.post(f"/v1/videos/{source['id']}/remix", json={"prompt": "too soon"})
        if early.status_code != 200:  # it may already have finished: then it is a remix
            assert early.status_code == 400 and early.json()["error"]["param"] == "video_id"
        await poll(client, source["id"], {"completed"})
        response = await client.post(f"/v1/videos/{source['id']}/remix", json={"prompt": "a ship"})
        assert response.status_code == 200, response.text
        remix = response.json()
        assert remix["remixed_from_video_id"] == source["id"] and remix["prompt"] == "a ship"
        assert (remix["size"], remix["seconds"]) == ("48x32", "2")
        await poll(client, remix["id"], {"completed"})
        retrieved = (await client.get(f"/v1/videos/{remix['id']}")).json()
        assert retrieved["remixed_from_video_id"] == source["id"]
        missing = await client.post("/v1/videos/video_nope/remix", json={"prompt": "x"})
        assert missing.status_code == 404
        unknown = await client.post(f"/v1/videos/{source['id']}/remix", json={"prompt": "x", "seconds": 9})
        assert unknown.status_code == 400  # only the prompt changes
    forwards = {r.prompt: r for r in harness.pipeline.seen}
    first, again = forwards["a boat"], forwards["a ship"]
    assert first.params.seed is not None and again.params.seed == first.params.seed
    assert (again.params.num_inference_steps, again.params.fps) == (3, 4)


async def test_a_video_made_from_an_input_reference_remixes_with_it(tmp_path: Path) -> None:
    harness = Harness(tmp_path, FakeImageToVideoPipeline())
    reference = np.random.default_rng(0).integers(0, 256, (64, 96, 3), dtype=np.uint8)
    upload = io.BytesIO()
    Image.fromarray(reference).save(upload, format="PNG")
    async with harness as client:
        created = await client.post(
            "/v1/videos",
            data={"prompt": "a boat", "seconds": "1", "size": "48x32"},
            files={"input_reference": ("ref.png", upload.getvalue(), "image/png")},
        )
        assert created.status_code == 200, created.text
        source = await poll(client, created.json()["id"], {"completed"})
        response = await client.post(f"/v1/videos/{source['id']}/remix", json={"prompt": "a ship"})
        assert response.status_code == 200, response.text
        remix = await poll(client, response.json()["id"], {"completed"})
        # Remixed again (from the remix): the reference travels on.
        again = await client.post(f"/v1/videos/{remix['id']}/remix", json={"prompt": "a raft"})
        await poll(client, again.json()["id"], {"completed"})
        kept = sorted(path.name for path in (tmp_path / "videos").glob(f"{source['id']}*"))
        assert any("reference" in name for name in kept), kept
        await client.delete(f"/v1/videos/{source['id']}")
        assert list((tmp_path / "videos").glob(f"{source['id']}*")) == []  # the reference went too
    runs = {r.prompt: r for r in harness.pipeline.seen}
    # The reference as reduced for the model, the same seed, the new prompt.
    for prompt in ("a boat", "a ship", "a raft"):
        assert np.array_equal(runs[prompt].input_images[0], reference[:32, :48]), prompt
        assert runs[prompt].params.seed == runs["a boat"].params.seed


async def test_a_remix_the_model_served_now_cannot_make_names_the_video(tmp_path: Path) -> None:
    async with Harness(tmp_path, FakeImageToVideoPipeline()) as client:
        created = await client.post(
            "/v1/videos",
            data={"prompt": "a boat", "seconds": "1"},
            files={"input_reference": ("ref.png", png(32, 32), "image/png")},
        )
        await poll(client, created.json()["id"], {"completed"})
    async with Harness(tmp_path) as client:  # now a text-to-video model
        response = await client.post(f"/v1/videos/{created.json()['id']}/remix", json={"prompt": "b"})
        error = response.json()["error"]
        assert response.status_code == 400 and error["param"] == "video_id", error
        assert "takes no input image" in error["message"]


async def test_a_remix_whose_adapter_is_no_longer_served_names_the_video(tmp_path: Path) -> None:
    async with Harness(tmp_path, lora_modules={"ghibli": "tiny-lora-1"}) as client:
        made = []
        for field in ("lora", "model"):
            created = await client.post("/v1/videos", json={"prompt": "a", "seconds": 1, field: "ghibli"})
            made.append(await poll(client, created.json()["id"], {"completed"}))
    async with Harness(tmp_path, lora_modules={"pixel": "tiny-lora-2"}) as client:
        for source in made:
            response = await client.post(f"/v1/videos/{source['id']}/remix", json={"prompt": "b"})
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["param"] == "video_id" and "'ghibli'" in error["message"], error
            assert "not served" in error["message"]


async def test_an_unknown_or_deleted_cursor_is_a_400_not_an_empty_page(tmp_path: Path) -> None:
    async with Harness(tmp_path) as client:
        ids = [
            (await client.post("/v1/videos", json={"prompt": f"p{i}", "seconds": 1})).json()["id"]
            for i in range(3)
        ]
        await client.delete(f"/v1/videos/{ids[1]}")
        for after in (ids[1], "video_never"):
            response = await client.get("/v1/videos", params={"after": after})
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["param"] == "after" and after in error["message"]
        too_long = await client.get("/v1/videos", params={"after": "v" * 10_000})
        assert too_long.status_code == 400 and "v" * 100 not in too_long.text
        listed = (await client.get("/v1/videos", params={"after": ids[2]})).json()
        assert [v["id"] for v in listed["data"]] == [ids[0]]


class BrokenAdapterVideoPipeline(FakeVideoPipeline):
    def forward(self, batch: RequestBatch) -> list[RequestOutput]:
        if batch.requests[0].params.lora is not None:  # as pipelines/lora.py words it
            raise InvalidRequestError(
                "the LoRA adapter 'broken' (/srv/models/x) cannot be loaded into tiny-wan: KeyError: 'w'",
                "model",
            )
        return super().forward(batch)


async def test_a_job_whose_adapter_fails_to_load_names_it_without_its_path(tmp_path: Path) -> None:
    harness = Harness(tmp_path, BrokenAdapterVideoPipeline(), lora_modules={"broken": "/srv/models/x"})
    async with harness as client:
        created = await client.post("/v1/videos", json={"prompt": "a", "seconds": 1, "lora": "broken"})
        failed = await poll(client, created.json()["id"], {"failed", "completed"})
    assert failed["status"] == "failed" and failed["error"]["code"] == "lora_unavailable", failed
    assert "'broken'" in failed["error"]["message"] and "/srv" not in failed["error"]["message"]


def as_key(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_a_key_sees_only_its_own_videos_and_an_admin_key_sees_all(tmp_path: Path) -> None:
    alice, bob, root = as_key("alice"), as_key("bob"), as_key("root")
    async with Harness(tmp_path) as client:  # before keys: a video of no tenant
        before = (await client.post("/v1/videos", json={"prompt": "before keys", "seconds": 1})).json()
        await poll(client, before["id"], {"completed"})
    async with Harness(tmp_path, api_key="alice, bob, root:admin") as client:
        made = await client.post("/v1/videos", json={"prompt": "hers", "seconds": 1}, headers=alice)
        hers = made.json()["id"]
        await poll(client, hers, {"completed"}, headers=alice)
        theirs = (await client.post("/v1/videos", json={"prompt": "his", "seconds": 1}, headers=bob)).json()
        for other in (hers, before["id"]):  # as if they did not exist
            for method, path in [
                ("GET", f"/v1/videos/{other}"),
                ("GET", f"/v1/videos/{other}/content"),
                ("POST", f"/v1/videos/{other}/remix"),
                ("DELETE", f"/v1/videos/{other}"),
            ]:
                response = await client.request(method, path, json={"prompt": "x"}, headers=bob)
                assert response.status_code == 404, (method, path, response.text)
            listed = await client.get("/v1/videos", params={"after": other}, headers=bob)
            assert listed.status_code == 400 and listed.json()["error"]["param"] == "after"

        async def listed_to(headers: dict[str, str]) -> list[str]:
            page = await client.get("/v1/videos", params={"order": "asc"}, headers=headers)
            return [v["id"] for v in page.json()["data"]]

        assert await listed_to(bob) == [theirs["id"]] and await listed_to(alice) == [hers]
        assert await listed_to(root) == [before["id"], hers, theirs["id"]]
        assert (await client.get(f"/v1/videos/{hers}/content", headers=root)).status_code == 200
        # An Idempotency-Key is the caller's own: bob's use of alice's makes bob a video.
        key = {"Idempotency-Key": "same"}
        first = await client.post("/v1/videos", json={"prompt": "k", "seconds": 1}, headers={**alice, **key})
        again = await client.post("/v1/videos", json={"prompt": "k", "seconds": 1}, headers={**bob, **key})
        assert first.json()["id"] != again.json()["id"]
        # A remix is the remixing key's video; the admin key's delete reaches any.
        remix = await client.post(f"/v1/videos/{hers}/remix", json={"prompt": "x"}, headers=root)
        assert (await client.get(f"/v1/videos/{remix.json()['id']}", headers=alice)).status_code == 404
        assert (await client.delete(f"/v1/videos/{theirs['id']}", headers=root)).status_code == 200
        assert (await client.get(f"/v1/videos/{theirs['id']}", headers=bob)).status_code == 404
