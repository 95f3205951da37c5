"""The Videos API with the official client against real `diffbatch serve tiny-wan` processes."""

from __future__ import annotations

import io
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from PIL import Image

from bench.launch import ServerProcess, kill_server, start_server, stop_server
from server.videos.encoding import probe_mp4
from tests.e2e.conftest import gated_env

pytestmark = [
    pytest.mark.slow,
    # The client marks its videos methods deprecated (OpenAI's Sora API); the wire format stands.
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]


@pytest.fixture(scope="module")
def video_gate(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Jobs whose prompt says HOLD wait while this file is absent (GatedWanTextToVideo)."""
    return tmp_path_factory.mktemp("gate") / "gate"


@pytest.fixture(scope="module")
def video_server(tmp_path_factory: pytest.TempPathFactory, video_gate: Path) -> Iterator[ServerProcess]:
    server = start_server(
        tmp_path_factory.mktemp("videos"),
        "tiny-wan",
        "--pipeline-class",
        "tests.pipelines.custom:GatedWanTextToVideo",
        # The gate holds a whole forward: request-level batching.
        "--batching",
        "request",
        config=None,
        env=gated_env(video_gate),
    )
    yield server
    video_gate.touch()
    stop_server(server)


@pytest.fixture
def client(video_server: ServerProcess) -> Iterator[openai.OpenAI]:
    """The official client of the video server, closed after the test (an unclosed one
    leaves a socket for the garbage collector: a ResourceWarning in a later test)."""
    with openai.OpenAI(base_url=video_server.v1, api_key="unused", max_retries=0) as opened:
        yield opened


def wait_for(server: ServerProcess, video_id: str, status: str, timeout_s: float = 60) -> dict[str, object]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        body: dict[str, object] = httpx.get(f"{server.v1}/videos/{video_id}").json()
        if body["status"] == status:
            return body
        time.sleep(0.05)
    raise AssertionError(f"video {video_id} never reached {status}")


def test_create_poll_download_list_delete(client: openai.OpenAI) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        video = client.videos.create_and_poll(
            model="tiny-wan",
            prompt="a paper boat on a pond",
            seconds="4",
            size="48x32",  # type: ignore[arg-type]
            poll_interval_ms=100,
        )
        assert video.status == "completed" and video.progress == 100
        assert str(video.size) == "48x32"
        # 4 s at Wan's 16 fps: 64 frames, rounded up to Wan's 4k+1.
        assert probe_mp4(client.videos.download_content(video.id).content) == (65, 48, 32, False)
        thumbnail = client.videos.download_content(video.id, variant="thumbnail").content
        assert thumbnail.startswith(b"\x89PNG")
        sheet = client.videos.download_content(video.id, variant="spritesheet").content
        assert Image.open(io.BytesIO(sheet)).size == (4 * 48, 4 * 32)  # 16 of the 65 frames
        assert video.id in [v.id for v in client.videos.list()]
        # A remix: the same settings and seed, a new prompt.
        remix = client.videos.remix(video.id, prompt="a paper ship on a pond")
        assert remix.remixed_from_video_id == video.id and remix.prompt == "a paper ship on a pond"
        remixed = client.videos.poll(remix.id, poll_interval_ms=100)
        assert remixed.status == "completed" and (remixed.size, remixed.seconds) == (
            video.size,
            video.seconds,
        )
        assert probe_mp4(client.videos.download_content(remix.id).content) == (65, 48, 32, False)
        client.videos.delete(video.id)
        with pytest.raises(openai.NotFoundError):
            client.videos.retrieve(video.id)


def test_a_video_deleted_while_queued_never_runs(
    video_server: ServerProcess, client: openai.OpenAI, video_gate: Path
) -> None:
    forwards_before = video_server.metric("diffbatch_batch_size_count")
    video_gate.unlink(missing_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        # A held job occupies the engine; the second (another size, so never batched with
        # it) waits in the queue and is deleted there.
        held = client.videos.create(prompt="HOLD", seconds="4", extra_body={"num_inference_steps": "2"})
        wait_for(video_server, held.id, "in_progress")
        queued = client.videos.create(prompt="never", seconds="1", size="48x32")  # type: ignore[arg-type]
        assert client.videos.retrieve(queued.id).status == "queued"
        client.videos.delete(queued.id)
        video_gate.touch()
        wait_for(video_server, held.id, "completed", timeout_s=120)
    assert video_server.metric("diffbatch_batch_size_count") - forwards_before == 1  # only the held one ran
    assert video_server.metric("diffbatch_requests_aborted_total") >= 1


def test_a_bad_request_fails_the_call(client: openai.OpenAI) -> None:
    with warnings.catch_warnings(), pytest.raises(openai.BadRequestError) as raised:
        warnings.simplefilter("ignore", DeprecationWarning)
        client.videos.create(prompt="a boat", size="33x33")  # type: ignore[arg-type]
    assert raised.value.body["param"] == "size"  # type: ignore[index]


def test_restart_serves_completed_videos_and_fails_killed_jobs(tmp_path: Path) -> None:
    # Long work on purpose, to be killed mid-run: beyond the default work budget.
    first = start_server(tmp_path, "tiny-wan", "--max-request-work", str(10**15), config=None, own_group=True)
    try:
        done = httpx.post(f"{first.v1}/videos", json={"prompt": "kept", "seconds": 1}).json()
        wait_for(first, done["id"], "completed")
        # Long enough to be killed mid-run: many steps of a long video.
        long = {"prompt": "cut short", "seconds": 30, "num_inference_steps": 500}
        killed = httpx.post(f"{first.v1}/videos", json=long).json()
        wait_for(first, killed["id"], "in_progress")
    finally:
        kill_server(first)  # every process of it: none fails the job on its way out
    second = start_server(tmp_path, "tiny-wan", config=None)
    try:
        content = httpx.get(f"{second.v1}/videos/{done['id']}/content")
        assert content.status_code == 200 and probe_mp4(content.content)[0] == 17
        after = httpx.get(f"{second.v1}/videos/{killed['id']}").json()
        assert after["status"] == "failed" and after["error"]["code"] == "server_restarted"
    finally:
        stop_server(second)


def test_a_video_beyond_the_work_budget_is_refused_at_once(video_server: ServerProcess) -> None:
    waiting_before = video_server.metric("diffbatch_num_requests_waiting")
    response = httpx.post(
        f"{video_server.v1}/videos",
        json={"prompt": "a minute", "seconds": 60, "fps": 17, "size": "2048x2048"},
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert "work budget" in error["message"] and "1021 frames" in error["message"]
    assert error["param"] in ("size", "seconds")
    assert video_server.metric("diffbatch_num_requests_waiting") == waiting_before


def test_deleting_a_running_video_frees_the_engine(video_server: ServerProcess, video_gate: Path) -> None:
    interrupted_before = video_server.metric("diffbatch_forwards_interrupted_total")
    video_gate.unlink(missing_ok=True)  # the job runs until it is deleted
    job = httpx.post(f"{video_server.v1}/videos", json={"prompt": "HOLD", "seconds": 1}).json()
    wait_for(video_server, job["id"], "in_progress")
    assert httpx.delete(f"{video_server.v1}/videos/{job['id']}").status_code == 200
    deadline = time.monotonic() + 120
    while video_server.metric("diffbatch_forwards_interrupted_total") <= interrupted_before:
        assert time.monotonic() < deadline, "the deleted job's forward was never interrupted"
        time.sleep(0.05)
    after = httpx.post(f"{video_server.v1}/videos", json={"prompt": "next", "seconds": 1}).json()
    wait_for(video_server, after["id"], "completed")
