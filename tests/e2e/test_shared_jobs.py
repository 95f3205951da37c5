"""Two `diffbatch serve tiny-wan` processes on one PostgreSQL database: a video made on one
is polled, listed, downloaded and deleted on the other, a server killed mid-job leaves
its job failed, with a reason, once its lease runs out, and the official client's retry
with an `Idempotency-Key` makes one video whichever server it reaches.

Outputs are not shared yet (object storage is another part of issue 28), so both servers
use the same `--output-dir`: that is what lets B serve the MP4 that A wrote.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import httpx2
import openai
import pytest

from bench.launch import ServerProcess, kill_server, spawn_server, start_server, stop_server, wait_until_ready
from server.videos.encoding import probe_mp4
from tests.e2e.conftest import gated_env
from tests.polling import wait_for
from tests.postgres import Cluster

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

# Short, so a dead server's job fails quickly; long enough that a busy machine still renews
# (three renewals per lease).
LEASE_S = 4.0


def shared_args(database_url: str) -> tuple[str, ...]:
    return (
        "tiny-wan",
        "--pipeline-class",
        "tests.pipelines.custom:GatedWanTextToVideo",
        "--batching",
        "request",
        "--database-url",
        database_url,
        "--job-lease-s",
        str(LEASE_S),
    )


@pytest.fixture(scope="module")
def gate(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Jobs whose prompt says HOLD wait while this file is absent (GatedWanTextToVideo)."""
    return tmp_path_factory.mktemp("gate") / "gate"


@pytest.fixture(scope="module")
def shared_url(postgres_cluster: Cluster) -> str:
    return postgres_cluster.create_database("shared_jobs")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("shared")  # one output directory for every server


@pytest.fixture(scope="module")
def pair(shared_url: str, workdir: Path, gate: Path) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    servers = [
        spawn_server(workdir, *shared_args(shared_url), config=None, env=gated_env(gate)) for _ in range(2)
    ]
    try:
        for server in servers:  # both load at once
            wait_until_ready(server)
        yield servers[0], servers[1]
    finally:
        gate.touch()
        for server in servers:
            stop_server(server)


def video_reaches(server: ServerProcess, video_id: str, status: str) -> dict[str, object]:
    """Poll `server` until the video has `status` (`wait_for`'s guard only stops a hang)."""
    seen: list[dict[str, object]] = []

    def reached() -> bool:
        seen.append(httpx.get(f"{server.v1}/videos/{video_id}").json())
        return seen[-1]["status"] == status

    wait_for(reached, f"video {video_id} to be {status} on {server.url}")
    return seen[-1]


def test_a_video_made_on_one_server_is_polled_downloaded_and_deleted_on_another(
    pair: tuple[ServerProcess, ServerProcess], gate: Path
) -> None:
    a, b = pair
    gate.touch()
    with (
        openai.OpenAI(base_url=a.v1, api_key="unused", max_retries=0) as on_a,
        openai.OpenAI(base_url=b.v1, api_key="unused", max_retries=0) as on_b,
    ):
        video = on_a.videos.create(prompt="a paper boat", seconds="1", size="48x32")  # type: ignore[arg-type]
        done = on_b.videos.poll(video.id, poll_interval_ms=100)
        assert done.status == "completed" and done.progress == 100
        assert video.id in [v.id for v in on_b.videos.list()]
        assert probe_mp4(on_b.videos.download_content(video.id).content)[:3] == (17, 48, 32)
        on_b.videos.delete(video.id)
        with pytest.raises(openai.NotFoundError):
            on_a.videos.retrieve(video.id)


def test_a_running_video_deleted_on_another_server_stops_running(
    pair: tuple[ServerProcess, ServerProcess], gate: Path
) -> None:
    a, b = pair
    interrupted_before = a.metric("diffbatch_forwards_interrupted_total")
    gate.unlink(missing_ok=True)  # the job runs until it is deleted
    job = httpx.post(f"{a.v1}/videos", json={"prompt": "HOLD", "seconds": 1}).json()
    video_reaches(b, job["id"], "in_progress")
    assert httpx.delete(f"{b.v1}/videos/{job['id']}").status_code == 200
    # A learns it at its next lease renewal and interrupts the forward.
    wait_for(
        lambda: a.metric("diffbatch_forwards_interrupted_total") > interrupted_before,
        "the job deleted on B to stop running on A",
    )
    gate.touch()
    after = httpx.post(f"{a.v1}/videos", json={"prompt": "next", "seconds": 1}).json()
    video_reaches(b, after["id"], "completed")


def test_a_job_of_a_killed_server_fails_on_another_once_its_lease_runs_out(
    pair: tuple[ServerProcess, ServerProcess], shared_url: str, workdir: Path, gate: Path
) -> None:
    _, b = pair
    gate.unlink(missing_ok=True)
    victim = start_server(workdir, *shared_args(shared_url), config=None, env=gated_env(gate), own_group=True)
    try:
        job = httpx.post(f"{victim.v1}/videos", json={"prompt": "HOLD", "seconds": 1}).json()
        video_reaches(b, job["id"], "in_progress")
    finally:
        kill_server(victim)  # every process of it: none fails the job on its way out
    killed_at = time.monotonic()
    failed = video_reaches(b, job["id"], "failed")
    # Within the lease, plus B's check (a third of its lease) and this poll's own steps.
    assert time.monotonic() - killed_at < LEASE_S * 3
    error = failed["error"]
    assert isinstance(error, dict) and error["code"] == "server_lost"
    assert "stopped before it was finished" in error["message"]
    gate.touch()


class LosesTheFirstAnswer(httpx2.BaseTransport):
    """Sends the first POST to server `first` and loses its answer (a timeout, as a dropped
    connection looks to a client); everything else goes where the client sends it. Written
    on httpx2, the official client's own HTTP library."""

    def __init__(self, first: ServerProcess) -> None:
        self._inner = httpx2.HTTPTransport()
        self._first = httpx2.URL(first.url)
        self.lost: list[dict[str, object]] = []

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        if request.method != "POST" or self.lost:
            return self._inner.handle_request(request)
        request.url = request.url.copy_with(host=self._first.host, port=self._first.port)
        response = self._inner.handle_request(request)
        self.lost.append(json.loads(response.read()))
        response.close()
        raise httpx2.ReadTimeout("the answer was lost", request=request)

    def close(self) -> None:
        self._inner.close()


def test_the_official_clients_retry_with_one_key_makes_one_video_on_any_server(
    pair: tuple[ServerProcess, ServerProcess], gate: Path
) -> None:
    a, b = pair
    gate.touch()
    transport = LosesTheFirstAnswer(a)
    key = {"Idempotency-Key": f"boat-{time.time_ns()}"}
    with openai.OpenAI(
        base_url=b.v1,
        api_key="unused",
        max_retries=2,
        http_client=openai.DefaultHttpxClient(transport=transport),
    ) as client:
        # The first attempt reaches A and its answer is lost; the client retries on B.
        video = client.videos.create(prompt="one boat", seconds="1", extra_headers=key)  # type: ignore[arg-type]
        assert len(transport.lost) == 1 and video.id == transport.lost[0]["id"]
        assert [v.id for v in client.videos.list(limit=100) if v.prompt == "one boat"] == [video.id]
        with pytest.raises(openai.ConflictError) as reused:  # 409, not retried (x-should-retry)
            client.videos.create(prompt="two boats", seconds="1", extra_headers=key)  # type: ignore[arg-type]
        assert reused.value.body["param"] == "Idempotency-Key"  # type: ignore[index]
        assert client.videos.poll(video.id, poll_interval_ms=100).status == "completed"


def test_an_unreachable_database_is_one_clear_line_at_start(tmp_path: Path) -> None:
    with socket_bound() as held:  # a port nothing answers on
        port = held.getsockname()[1]
        result = subprocess.run(
            [
                str(Path(sys.executable).parent / "diffbatch"),
                "serve",
                "tiny-wan",
                "--output-dir",
                str(tmp_path),
                "--database-url",
                f"postgresql://someone:secret@127.0.0.1:{port}/jobs",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("diffbatch: --database-url: cannot use"), result.stderr
    assert "secret" not in result.stderr and "someone:***@127.0.0.1" in result.stderr
    assert "Traceback" not in result.stderr


def socket_bound() -> socket.socket:
    """A TCP port held (bound, not listening) for the duration: connections are refused."""
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    return held
