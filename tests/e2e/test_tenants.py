"""API keys as tenants (issue 39), end to end: two `diffbatch serve tiny-wan` processes sharing
one PostgreSQL database and one bucket, each with its own --output-dir, and the same keys
(`alice`, `bob`, the operator key `root:admin`) and `--tenant-secret`. Neither key sees,
downloads, remixes or deletes the other's videos on either server; each reaches its own on
both; the admin key sees both."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import openai
import pytest
from openai.resources.videos import Videos

from bench.launch import ServerProcess, spawn_server, stop_server, wait_until_ready
from server.videos.encoding import probe_mp4
from tests.postgres import Cluster
from tests.s3 import CREDENTIALS, S3Server

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

KEYS = "alice,bob,root:admin"


@pytest.fixture(scope="module")
def pair(
    postgres_cluster: Cluster, s3_server: S3Server, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    args = (
        "tiny-wan",
        "--batching",
        "request",
        "--database-url",
        postgres_cluster.create_database("tenants"),
        "--output-url",
        f"s3://{s3_server.new_bucket()}/jobs",
        "--s3-endpoint-url",
        s3_server.endpoint_url,
        "--api-key",
        KEYS,
        "--tenant-secret",
        "shared by both servers",
    )
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


def client(server: ServerProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key=key, max_retries=0)


def assert_out_of_reach(videos: Videos, video_id: str) -> None:
    """Every call on another tenant's video is a 404, as on one that does not exist."""
    with pytest.raises(openai.NotFoundError):
        videos.retrieve(video_id)
    with pytest.raises(openai.NotFoundError):
        videos.download_content(video_id)
    with pytest.raises(openai.NotFoundError):
        videos.remix(video_id, prompt="mine now")
    with pytest.raises(openai.NotFoundError):
        videos.delete(video_id)


def test_two_keys_on_two_servers_see_only_their_own_videos_and_an_admin_key_sees_both(
    pair: tuple[ServerProcess, ServerProcess],
) -> None:
    a, b = pair
    with contextlib.ExitStack() as stack:
        clients = {
            (key, server.url): stack.enter_context(client(server, key))
            for key in ("alice", "bob", "root")
            for server in pair
        }
        alice_a, bob_b = clients["alice", a.url], clients["bob", b.url]
        hers = alice_a.videos.create(prompt="a paper boat", seconds="1", size="48x32")  # type: ignore[arg-type]
        his = bob_b.videos.create(prompt="a red kite", seconds="1", size="48x32")  # type: ignore[arg-type]
        # Each polls its own on the other server (the same tenant there: the same secret).
        assert clients["alice", b.url].videos.poll(hers.id, poll_interval_ms=100).status == "completed"
        assert clients["bob", a.url].videos.poll(his.id, poll_interval_ms=100).status == "completed"

        for server in pair:
            for key, own, other in (("alice", hers.id, his.id), ("bob", his.id, hers.id)):
                videos = clients[key, server.url].videos
                assert [v.id for v in videos.list()] == [own]
                assert_out_of_reach(videos, other)
                assert probe_mp4(videos.download_content(own).content)[:3] == (17, 48, 32)
            root = clients["root", server.url].videos
            assert {v.id for v in root.list()} == {hers.id, his.id}
            assert probe_mp4(root.download_content(his.id).content)[:3] == (17, 48, 32)

        # What the other tried deleted nothing; the owner's delete does.
        clients["bob", a.url].videos.delete(his.id)
        with pytest.raises(openai.NotFoundError):
            clients["root", b.url].videos.retrieve(his.id)
        assert clients["root", a.url].videos.retrieve(hers.id).status == "completed"
