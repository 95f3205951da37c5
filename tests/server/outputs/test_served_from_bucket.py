"""The Videos and Images APIs in process with `--output-url`: files go to a bucket on moto's
S3 server, clients are sent there by presigned URLs (or streamed through the server), and
deleting or expiring a video removes its objects."""

from __future__ import annotations

import logging
from pathlib import Path

import httpx
import pytest

import server.app
from server.app import purge_once
from server.videos.encoding import probe_mp4
from tests.s3 import S3Server
from tests.server.test_videos_api import Harness, poll

pytestmark = pytest.mark.usefixtures("s3_credentials")


def bucket_settings(s3_server: S3Server, bucket: str, **values: object) -> dict[str, object]:
    return {"output_url": f"s3://{bucket}/out", "s3_endpoint_url": s3_server.endpoint_url, **values}


async def test_a_video_is_stored_downloaded_by_presigned_url_and_deleted(
    tmp_path: Path, s3_server: S3Server
) -> None:
    bucket = s3_server.new_bucket()
    async with Harness(tmp_path, None, **bucket_settings(s3_server, bucket)) as client:
        created = (await client.post("/v1/videos", json={"prompt": "a boat", "seconds": 1})).json()
        await poll(client, created["id"], {"completed"})
        video_id = created["id"]
        assert s3_server.keys(bucket) == [
            f"out/videos/{video_id}.mp4",
            f"out/videos/{video_id}.png",
            f"out/videos/{video_id}.sprites.png",
        ]
        content = await client.get(f"/v1/videos/{video_id}/content")
        assert content.status_code == 307
        fetched = httpx.get(content.headers["location"])  # the client goes to the bucket itself
        assert fetched.headers["content-type"] == "video/mp4" and probe_mp4(fetched.content)[0] == 9
        thumbnail = await client.get(f"/v1/videos/{video_id}/content", params={"variant": "thumbnail"})
        assert httpx.get(thumbnail.headers["location"]).content.startswith(b"\x89PNG")
        assert (await client.delete(f"/v1/videos/{video_id}")).status_code == 200
        assert s3_server.keys(bucket) == []
    assert not (tmp_path / "videos" / f"{video_id}.mp4").exists()


async def test_with_proxy_content_the_server_streams_the_object(tmp_path: Path, s3_server: S3Server) -> None:
    bucket = s3_server.new_bucket()
    async with Harness(tmp_path, None, **bucket_settings(s3_server, bucket, proxy_content=True)) as client:
        created = (await client.post("/v1/videos", json={"prompt": "a boat", "seconds": 1})).json()
        await poll(client, created["id"], {"completed"})
        content = await client.get(f"/v1/videos/{created['id']}/content")
        assert content.status_code == 200 and content.headers["content-type"] == "video/mp4"
        assert probe_mp4(content.content)[0] == 9


async def no_cleanup(state: object) -> None:
    """Instead of the app's cleanup loop: the test purges when it has looked."""


async def test_no_object_is_left_after_expiry(
    tmp_path: Path, s3_server: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(server.app, "purge_forever", no_cleanup)
    bucket = s3_server.new_bucket()
    harness = Harness(tmp_path, None, **bucket_settings(s3_server, bucket, video_ttl_s=0.001))
    async with harness as client:
        created = (await client.post("/v1/videos", json={"prompt": "a boat", "seconds": 1})).json()
        await poll(client, created["id"], {"completed"})
        assert s3_server.keys(bucket) != []
        await purge_once(harness.app.state.diffbatch)
        assert s3_server.keys(bucket) == []
        assert (await client.get(f"/v1/videos/{created['id']}")).status_code == 404


async def test_url_images_are_presigned_links_into_the_bucket(
    make_client: object, tmp_path: Path, s3_server: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(server.app, "purge_forever", no_cleanup)
    bucket = s3_server.new_bucket()
    client = await make_client(**bucket_settings(s3_server, bucket, image_url_ttl_s=0.001))  # type: ignore[operator]
    answer = await client.post("/v1/images/generations", json={"prompt": "a cat", "response_format": "url"})
    url = answer.json()["data"][0]["url"]
    assert url.startswith(f"{s3_server.endpoint_url}/{bucket}/out/images/") and "X-Amz-Signature=" in url
    assert httpx.get(url).content.startswith(b"\x89PNG")
    await purge_once(client._transport.app.state.diffbatch)
    assert s3_server.keys(bucket) == []


async def test_a_bucket_that_is_gone_is_a_503_naming_the_output_store_and_logged_once(
    make_client: object, tmp_path: Path, s3_server: S3Server, caplog: pytest.LogCaptureFixture
) -> None:
    bucket = s3_server.new_bucket()
    client = await make_client(**bucket_settings(s3_server, bucket))  # type: ignore[operator]
    s3_server.client().delete_bucket(Bucket=bucket)  # an operator removed it
    with caplog.at_level(logging.ERROR, logger="server.outputs.s3"):
        for _ in range(2):
            answer = await client.post(
                "/v1/images/generations", json={"prompt": "a", "response_format": "url"}
            )
            assert answer.status_code == 503 and answer.headers["x-should-retry"] == "true"
            error = answer.json()["error"]
            assert error["code"] == "output_store_unavailable" and f"s3://{bucket}/out/" in error["message"]
    reasons = [record.getMessage() for record in caplog.records if "no longer exists" in record.getMessage()]
    assert len(reasons) == 1 and bucket in reasons[0], caplog.text


async def test_a_video_made_while_its_bucket_is_gone_fails_naming_the_output_store(
    tmp_path: Path, s3_server: S3Server
) -> None:
    bucket = s3_server.new_bucket()
    async with Harness(tmp_path, None, **bucket_settings(s3_server, bucket)) as client:
        s3_server.client().delete_bucket(Bucket=bucket)
        created = (await client.post("/v1/videos", json={"prompt": "a boat", "seconds": 1})).json()
        failed = await poll(client, created["id"], {"completed", "failed"})
    assert failed["status"] == "failed" and failed["error"]["code"] == "output_store_unavailable"
    assert f"s3://{bucket}/out/" in failed["error"]["message"]
