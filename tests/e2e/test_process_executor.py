"""`diffbatch serve --executor process`: the model in a worker process, driven by the
official client in both batching modes; a worker killed under load; SIGTERM while a worker
restarts; nothing left behind, no process of the server's group either."""

from __future__ import annotations

import base64
import io
import os
import re
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from bench.launch import spawn_server, wait_until_ready
from engine.executor.shm import segments
from tests.e2e.conftest import Server, gated_env, group_left, start_server, stop_server
from tests.polling import wait_for

pytestmark = pytest.mark.slow


def worker_pid(server: Server) -> int:
    pids = re.findall(r"worker process (\d+) serving", server.log.read_text())
    assert pids, server.log.read_text()
    return int(pids[-1])


def pixels(b64: str | None) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64 or ""))).convert("RGB"))


def test_images_and_previews_through_a_worker_process(tmp_path: Path) -> None:
    """The same pipeline in a thread and in a worker process makes the same images, in step
    batching (with streamed previews) and in request batching (within 1/255 of the step
    image: the two batchings' promise); they come through shared memory. Three servers load
    at once."""
    before = set(segments("diffbatch-"))
    servers = []
    for name, args in (
        ("t", ["--batching", "step"]),
        ("p", ["--batching", "step", "--executor", "process"]),
        ("r", ["--batching", "request", "--executor", "process"]),
    ):
        (tmp_path / name).mkdir()
        servers.append(spawn_server(tmp_path / name, *args))
    _, process, request_level = servers
    try:
        for server in servers:
            wait_until_ready(server)
        pids = [worker_pid(process), worker_pid(request_level)]
        results = []
        for server in servers:
            with openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0) as client:
                extra = {"seed": 5, "num_inference_steps": 2}
                results.append(
                    client.images.generate(prompt="a red cat", size="192x192", n=2, extra_body=extra)
                )
        in_thread, in_worker, in_worker_by_request = (
            [pixels(d.b64_json) for d in r.data or []] for r in results
        )
        assert len(in_worker) == len(in_worker_by_request) == 2
        for a, b, c in zip(in_thread, in_worker, in_worker_by_request, strict=True):
            assert np.array_equal(a, b)  # the same pipeline, wherever it runs
            assert np.abs(a.astype(int) - c.astype(int)).max() <= 1
        # 192x192x3 images are above the shared-memory threshold: they came through it.
        for server in (process, request_level):
            assert server.metric("diffbatch_shm_arrays_received_total") >= 2
        with openai.OpenAI(base_url=process.v1, api_key="unused", max_retries=0) as client:
            events = list(
                client.images.generate(
                    prompt="a red cat",
                    size="64x64",
                    stream=True,
                    partial_images=2,
                    extra_body={"num_inference_steps": 6},
                )
            )
        assert [e.type for e in events][-1] == "image_generation.completed"
        assert [e.type for e in events].count("image_generation.partial_image") == 2
        # The worker's decode records came back with its results.
        assert process.metric("diffbatch_decode_batch_size_sum") >= 2
    finally:
        for server in servers:
            stop_server(server)
    for server in (process, request_level):
        assert server.process.returncode in (0, -signal.SIGTERM)
    assert not any(Path(f"/proc/{pid}").exists() for pid in pids)  # no orphan worker
    assert set(segments("diffbatch-")) <= before  # none new (orphans of dead processes may be swept)


def test_a_worker_killed_under_load_fails_only_its_requests_and_comes_back(tmp_path: Path) -> None:
    """A worker killed in a forward fails that forward's request (503), the queued ones are
    served by its replacement. Then the next replacement is still loading when the server
    gets SIGTERM: shutdown stops it (no BrokenPipeError traceback from a worker reporting
    ready to a server that is gone), and no process of the server's group outlives it."""
    gate = tmp_path / "gate"
    hold = gate.with_suffix(".hold-load")  # while it exists, a worker waits in its load
    server = start_server(
        tmp_path,
        "--executor",
        "process",
        "--pipeline-class",
        "tests.pipelines.custom:SlowLoadingTextToImage",
        env=gated_env(gate),
        own_group=True,
    )
    try:
        first = worker_pid(server)
        with (
            openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0) as client,
            ThreadPoolExecutor(6) as pool,
        ):
            held = pool.submit(client.images.generate, prompt="HOLD", size="64x64")
            wait_for(lambda: gate.with_suffix(".entered").exists(), "the forward holds")
            # Queued behind the held forward, with another shape (another batch).
            queued = [
                pool.submit(client.images.generate, prompt=f"a cat {i}", size="32x32", extra_body={"seed": i})
                for i in range(4)
            ]
            wait_for(
                lambda: server.metric("diffbatch_num_requests_waiting") >= 4, "all four queued behind it"
            )
            os.kill(first, signal.SIGKILL)
            with pytest.raises(openai.InternalServerError) as raised:
                held.result(timeout=60)
            assert raised.value.status_code == 503
            assert raised.value.body["code"] == "worker_restarting"  # type: ignore[index]
            health = httpx.get(f"{server.url}/health")
            assert health.status_code == 503 and health.json()["status"] == "degraded"
            assert all(len(f.result(timeout=120).data or []) == 1 for f in queued)  # served by the new worker
        assert httpx.get(f"{server.url}/health").status_code == 200
        second = worker_pid(server)
        assert second != first
        assert server.metric("diffbatch_worker_restarts_total") == 1
        assert "died (exit code -9)" in server.log.read_text()

        hold.touch()
        os.kill(second, signal.SIGKILL)
        wait_for(lambda: bool(list(tmp_path.glob("gate.loading-*"))), "the next worker is loading")
        (loading,) = tmp_path.glob("gate.loading-*")
        stop_server(server)
        # uvicorn re-raises the signal once it has shut down: the server ends as SIGTERM says.
        assert server.process.returncode == -signal.SIGTERM
        assert group_left(server.process.pid) == []  # the loading worker, the resource tracker
    finally:
        hold.unlink(missing_ok=True)  # a worker left loading (main) now reports ready, to nobody
        gate.touch()
        stop_server(server)
    log = server.log.read_text()
    assert "Traceback" not in log, log
    assert f"worker process {loading.suffix.rsplit('-', 1)[1]}: loading tiny-sd" in log
