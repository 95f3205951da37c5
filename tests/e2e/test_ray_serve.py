"""diffbatch on Ray Serve: a real local Ray cluster (`ray start --head` on loopback, started
and stopped here), `diffbatch serve --ray-address` with 2 engine replicas, the official
client through Serve's HTTP proxy. A replica killed under load is replaced; stopping the
app and the cluster leaves no process behind."""

from __future__ import annotations

import os
import signal
import time
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from bench.launch import ServerProcess, spawn_server, stop_server, wait_until_ready
from bench.ray_cluster import LocalCluster, processes_mentioning, start_cluster

pytest.importorskip("ray.serve", reason="the [ray] extra is not installed")
pytestmark = pytest.mark.slow


def wait_for(check: Callable[[], bool], what: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.1)
    raise AssertionError(f"never happened: {what}")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    gate = tmp_path_factory.mktemp("ray") / "gate"
    # The replicas are the cluster's workers: they see the gate through its environment.
    local = start_cluster(extra_env={"DIFFBATCH_TEST_GATE": str(gate)})
    try:
        yield local
    finally:
        leftover = local.stop()
        assert not leftover, f"Ray processes left behind: {leftover}"


def serve_on(
    cluster: LocalCluster, workdir: Path, *args: str, config: str | None = "tiny-sd.yaml"
) -> ServerProcess:
    server = spawn_server(
        workdir, "--ray-address", cluster.address, "--replicas", "2", *args, config=config, env=cluster.env
    )
    wait_until_ready(server, timeout_s=300)
    return server


def replica_pids() -> list[int]:
    return processes_mentioning("ServeReplica:diffbatch:EngineReplica")


def test_images_through_the_serve_proxy_and_a_replica_killed_under_load(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    gate = Path(cluster.env["DIFFBATCH_TEST_GATE"])
    server = serve_on(
        cluster,
        tmp_path,
        "--batching",
        "request",
        "--pipeline-class",
        "tests.pipelines.custom:GatedTextToImage",
    )
    try:
        assert len(replica_pids()) == 2
        with (
            openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0) as client,
            ThreadPoolExecutor(8) as pool,
        ):
            result = client.images.generate(prompt="a red cat", size="64x64", n=2, extra_body={"seed": 3})
            assert len(result.data or []) == 2 and all(d.b64_json for d in result.data or [])
            with pytest.raises(openai.BadRequestError) as bad:
                client.images.generate(prompt="a cat", size="63x64")
            assert bad.value.body["param"] == "size"  # type: ignore[index]
            # Two shapes at once: each goes to its own replica, both serve.
            mixed = [
                pool.submit(client.images.generate, prompt=f"cat {i}", size=["64x64", "32x32"][i % 2])
                for i in range(8)
            ]
            assert all(len(f.result(timeout=120).data or []) == 1 for f in mixed)
            answers = [
                server.metric(f'diffbatch_replica_requests_total{{replica="{r}"}}')
                for r in replica_ids(server)
            ]
            assert len(answers) == 2 and min(answers) >= 1

            held = pool.submit(client.images.generate, prompt="HOLD", size="64x64")
            wait_for(lambda: bool(list(gate.parent.glob("gate.entered-*"))), "a replica holds the request")
            (entered,) = gate.parent.glob("gate.entered-*")
            victim = int(entered.suffix.rsplit("-", 1)[1])
            assert victim in replica_pids()
            os.kill(victim, signal.SIGKILL)
            with pytest.raises(openai.InternalServerError) as raised:
                held.result(timeout=120)
            assert raised.value.status_code == 503
            assert raised.value.body["code"] == "worker_restarting"  # type: ignore[index]
            entered.unlink()
            # The other replica serves on, and Ray starts a new one.
            assert len(client.images.generate(prompt="still served", size="32x32").data or []) == 1
            wait_for(lambda: len(replica_pids()) == 2 and victim not in replica_pids(), "a new replica")
            gate.touch()
            after = [pool.submit(client.images.generate, prompt=f"after {i}", size="32x32") for i in range(4)]
            assert all(len(f.result(timeout=300).data or []) == 1 for f in after)
        assert httpx.get(f"{server.url}/health").status_code == 200
    finally:
        gate.touch()
        stop_server(server)
    assert server.process.returncode == 0, server.log.read_text()
    wait_for(lambda: not replica_pids(), "the replicas are gone after the app stopped", timeout_s=60)
    assert not processes_mentioning("ServeController") and not processes_mentioning("ProxyActor")


def replica_ids(server: ServerProcess) -> list[str]:
    lines = httpx.get(f"{server.url}/metrics").text.splitlines()
    prefix = 'diffbatch_replica_requests_total{replica="'
    return [line[len(prefix) :].split('"', 1)[0] for line in lines if line.startswith(prefix)]


def test_video_jobs_through_the_serve_proxy(cluster: LocalCluster, tmp_path: Path) -> None:
    server = serve_on(cluster, tmp_path, "tiny-wan", config=None)
    try:
        with (
            openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0) as client,
            warnings.catch_warnings(),
        ):
            warnings.simplefilter("ignore", DeprecationWarning)
            video = client.videos.create_and_poll(
                model="tiny-wan",
                prompt="a paper boat",
                seconds="4",
                size="48x32",  # type: ignore[arg-type]
                poll_interval_ms=200,
            )
            assert video.status == "completed" and video.progress == 100, video
            content = client.videos.download_content(video.id).read()
            assert content[4:8] == b"ftyp"  # an MP4
            assert client.videos.retrieve(video.id).status == "completed"
    finally:
        stop_server(server)
    assert server.process.returncode == 0, server.log.read_text()
