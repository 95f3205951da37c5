"""`Idempotency-Key` on the POSTs that make videos, in process, on both job stores."""

from __future__ import annotations

import asyncio
from pathlib import Path

from tests.media import png
from tests.server.test_videos_api import Harness, job_database, poll

__all__ = ["job_database"]  # the fixture that runs each test on both stores

KEY = {"Idempotency-Key": "create-boat-1"}


async def test_a_retry_with_the_key_returns_the_first_video_and_runs_nothing_again(tmp_path: Path) -> None:
    harness = Harness(tmp_path)
    async with harness as client:
        # As the official client sends it: multipart, with a new boundary on every attempt.
        body = {"prompt": (None, "a boat"), "seconds": (None, "1"), "size": (None, "48x32")}
        first = (await client.post("/v1/videos", files=body, headers=KEY)).json()
        await poll(client, first["id"], {"completed"})
        again = await client.post("/v1/videos", files=body, headers=KEY)
        assert again.status_code == 200 and again.json()["id"] == first["id"]
        assert again.json()["status"] == "completed"  # its state now
        together = await asyncio.gather(
            *(
                client.post(
                    "/v1/videos", json={"prompt": "b", "seconds": 1}, headers={"Idempotency-Key": "b"}
                )
                for _ in range(3)
            )
        )
        assert len({r.json()["id"] for r in together}) == 1
        listed = (await client.get("/v1/videos")).json()["data"]
        assert len(listed) == 2
        # Without a key, the same body is another video.
        other = (await client.post("/v1/videos", json={"prompt": "b", "seconds": 1})).json()
        assert other["id"] != together[0].json()["id"]
        for video in (together[0].json(), other):  # what ran, once each job has ended
            await poll(client, video["id"], {"completed"})
    ran = [r.prompt for r in harness.pipeline.seen]
    assert sorted(ran) == ["a boat", "b", "b"]


async def test_the_key_with_another_request_is_a_409_naming_the_header(tmp_path: Path) -> None:
    async with Harness(tmp_path) as client:
        assert (
            await client.post("/v1/videos", json={"prompt": "a", "seconds": 1}, headers=KEY)
        ).status_code == 200
        reused = await client.post("/v1/videos", json={"prompt": "a", "seconds": 2}, headers=KEY)
        assert reused.status_code == 409 and reused.headers["x-should-retry"] == "false"
        error = reused.json()["error"]
        assert error["param"] == "Idempotency-Key" and error["code"] == "idempotency_key_reused"
        # Another caller (API key) or endpoint has keys of its own.
        theirs = await client.post(
            "/v1/videos", json={"prompt": "a", "seconds": 2}, headers={**KEY, "Authorization": "Bearer other"}
        )
        assert theirs.status_code == 200


async def test_a_request_that_made_nothing_leaves_its_key_free(tmp_path: Path) -> None:
    async with Harness(tmp_path) as client:
        # Refused by the model (this text-to-video model takes no image): nothing was made.
        image = {"input_reference": ("a.png", png(16, 16), "image/png")}
        bad = await client.post("/v1/videos", data={"prompt": "a"}, files=image, headers=KEY)
        assert bad.status_code == 400 and "takes no input image" in bad.text
        fixed = await client.post("/v1/videos", json={"prompt": "a"}, headers=KEY)
        assert fixed.status_code == 200
        malformed = await client.post(
            "/v1/videos", json={"prompt": "a"}, headers={"Idempotency-Key": "x" * 256}
        )
        assert malformed.status_code == 400 and malformed.json()["error"]["param"] == "Idempotency-Key"


async def test_a_remix_retried_with_its_key_is_made_once(tmp_path: Path) -> None:
    async with Harness(tmp_path) as client:
        source = (await client.post("/v1/videos", json={"prompt": "a", "seconds": 1})).json()
        await poll(client, source["id"], {"completed"})
        path = f"/v1/videos/{source['id']}/remix"
        first = (await client.post(path, json={"prompt": "b"}, headers=KEY)).json()
        again = (await client.post(path, json={"prompt": "b"}, headers=KEY)).json()
        assert again["id"] == first["id"]
        other = await client.post(path, json={"prompt": "c"}, headers=KEY)
        assert other.status_code == 409
