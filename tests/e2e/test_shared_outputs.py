"""Two `diffbatch serve tiny-wan` processes on one PostgreSQL database and one bucket (moto's
S3 server on loopback), each with its own --output-dir: a video made on A is polled,
downloaded (through a presigned URL into the bucket) and deleted on B; a video left alone
leaves no object once it expires; a missing bucket stops the start with one line."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from bench.launch import ServerProcess, spawn_server, stop_server, wait_until_ready
from server.videos.encoding import probe_mp4
from tests.polling import wait_for
from tests.postgres import Cluster
from tests.s3 import CREDENTIALS, S3Server

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

# Short, so the expiry test ends soon (the cleanup runs this often too); long enough for the
# first test to download before its video expires on a busy machine.
VIDEO_TTL_S = 20.0


@pytest.fixture(scope="module")
def bucket(s3_server: S3Server) -> str:
    return s3_server.new_bucket()


@pytest.fixture(scope="module")
def pair(
    postgres_cluster: Cluster, s3_server: S3Server, bucket: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    database_url = postgres_cluster.create_database("shared_outputs")
    args = (
        "tiny-wan",
        "--batching",
        "request",
        "--database-url",
        database_url,
        "--output-url",
        f"s3://{bucket}/jobs",
        "--s3-endpoint-url",
        s3_server.endpoint_url,
        "--video-ttl-s",
        str(VIDEO_TTL_S),
    )
    # Each its own directory: only the bucket and the database are shared.
    servers = [
        spawn_server(tmp_path_factory.mktemp(name), *args, config=None, env=CREDENTIALS) for name in "ab"
    ]
    try:
        for server in servers:  # both load at once
            wait_until_ready(server)
        yield servers[0], servers[1]
    finally:
        for server in servers:
            stop_server(server)


def test_a_video_made_on_one_server_is_downloaded_and_deleted_on_another(
    pair: tuple[ServerProcess, ServerProcess], s3_server: S3Server, bucket: str
) -> None:
    a, b = pair
    with (
        openai.OpenAI(base_url=a.v1, api_key="unused", max_retries=0) as on_a,
        openai.OpenAI(base_url=b.v1, api_key="unused", max_retries=0) as on_b,
    ):
        video = on_a.videos.create(prompt="a paper boat", seconds="1", size="48x32")  # type: ignore[arg-type]
        assert on_b.videos.poll(video.id, poll_interval_ms=100).status == "completed"
        assert f"jobs/videos/{video.id}.mp4" in s3_server.keys(bucket)
        # B answers with a presigned URL; the client follows it into the bucket.
        redirect = httpx.get(f"{b.v1}/videos/{video.id}/content")
        assert redirect.status_code == 307 and redirect.headers["location"].startswith(s3_server.endpoint_url)
        assert probe_mp4(on_b.videos.download_content(video.id).content)[:3] == (17, 48, 32)
        on_b.videos.delete(video.id)
        with pytest.raises(openai.NotFoundError):
            on_a.videos.retrieve(video.id)
    assert [key for key in s3_server.keys(bucket) if video.id in key] == []


def test_no_object_is_left_after_expiry(
    pair: tuple[ServerProcess, ServerProcess], s3_server: S3Server, bucket: str
) -> None:
    a, b = pair
    job = httpx.post(f"{a.v1}/videos", json={"prompt": "left alone", "seconds": 1}).json()
    wait_for(lambda: httpx.get(f"{b.v1}/videos/{job['id']}").json().get("status") == "completed", "completed")
    assert any(job["id"] in key for key in s3_server.keys(bucket))
    # Whichever server purges first takes the row, then removes the objects.
    wait_for(lambda: not any(job["id"] in key for key in s3_server.keys(bucket)), "its objects removed")
    assert httpx.get(f"{b.v1}/videos/{job['id']}").status_code == 404


def test_a_missing_bucket_is_one_clear_line_at_start(s3_server: S3Server, tmp_path: Path) -> None:
    result = subprocess.run(
        [
            str(Path(sys.executable).parent / "diffbatch"),
            "serve",
            "tiny-wan",
            "--output-dir",
            str(tmp_path),
            "--output-url",
            "s3://no-such-bucket/x",
            "--s3-endpoint-url",
            s3_server.endpoint_url,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, **CREDENTIALS},
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert lines == [
        f"diffbatch: --output-url: there is no bucket 'no-such-bucket' at {s3_server.endpoint_url}"
    ]
