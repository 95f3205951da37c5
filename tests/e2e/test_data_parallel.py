"""`diffbatch serve --data-parallel-size 2`: one endpoint, two worker processes. Requests
are served by one worker while the other is busy, a killed worker costs only its own
request while the other serves on, both send input images through shared memory at once
without touching each other's, and nothing is left behind."""

from __future__ import annotations

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

from engine.executor.shm import SHM_MIN_BYTES, segments
from tests.e2e.conftest import gated_env, group_left, start_server, stop_server
from tests.e2e.test_process_executor import pixels, worker_pid
from tests.media import picture
from tests.polling import wait_for

pytestmark = pytest.mark.slow


def test_two_workers_serve_side_by_side_and_survive_a_kill(tmp_path: Path) -> None:
    before = set(segments("diffbatch-"))
    gate = tmp_path / "gate"
    server = start_server(
        tmp_path,
        "--data-parallel-size",
        "2",
        "--batching",
        "request",
        "--pipeline-class",
        "tests.pipelines.custom:GatedTextToImage",
        env=gated_env(gate),
    )
    try:
        pids = {int(p) for p in re.findall(r"worker process (\d+) serving", server.log.read_text())}
        assert len(pids) == 2, server.log.read_text()
        assert server.metric("diffbatch_workers ") == 2 and server.metric("diffbatch_workers_up") == 2
        with (
            openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0) as client,
            ThreadPoolExecutor(6) as pool,
        ):
            held = pool.submit(client.images.generate, prompt="HOLD", size="64x64")
            wait_for(lambda: gate.with_suffix(".entered").exists(), "a worker holds the HOLD request")
            (busy,) = (int(p.suffix.rsplit("-", 1)[1]) for p in tmp_path.glob("gate.entered-*"))
            # One worker is held: the other serves these meanwhile (one worker never could).
            beside = [
                pool.submit(client.images.generate, prompt=f"a cat {i}", size="32x32", extra_body={"seed": i})
                for i in range(4)
            ]
            assert all(len(f.result(timeout=120).data or []) == 1 for f in beside)
            assert not held.done()
            os.kill(busy, signal.SIGKILL)
            with pytest.raises(openai.InternalServerError) as raised:
                held.result(timeout=60)
            assert raised.value.status_code == 503
            assert raised.value.body["code"] == "worker_restarting"  # type: ignore[index]
            health = httpx.get(f"{server.url}/health")  # the other worker still serves
            assert health.status_code == 200 and health.json()["workers_up"] == 1, health.text
            assert len(client.images.generate(prompt="still served", size="32x32").data or []) == 1
            wait_for(lambda: server.metric("diffbatch_workers_up") == 2, "the killed worker is back")
        health = httpx.get(f"{server.url}/health").json()
        assert health["status"] == "ok" and "workers_up" not in health, health
        assert server.metric("diffbatch_worker_restarts_total") == 1
        assert server.metric('diffbatch_worker_runs_total{worker="0"}') >= 1
        assert server.metric('diffbatch_worker_runs_total{worker="1"}') >= 1
        pids.add(worker_pid(server))
    finally:
        gate.touch()
        stop_server(server)
    assert server.process.returncode in (0, -signal.SIGTERM)
    assert not [pid for pid in pids if Path(f"/proc/{pid}").exists()]  # no orphan worker
    assert set(segments("diffbatch-")) <= before  # none new (orphans of dead processes may be swept)


def test_two_workers_in_step_mode(tmp_path: Path) -> None:
    server = start_server(tmp_path, "--data-parallel-size", "2")
    try:
        with (
            openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0) as client,
            ThreadPoolExecutor(8) as pool,
        ):
            sizes = ["64x64", "32x32"] * 4
            futures = [
                pool.submit(client.images.generate, prompt=f"a dog {i}", size=size, extra_body={"seed": i})
                for i, size in enumerate(sizes)
            ]
            assert all(len(f.result(timeout=180).data or []) == 1 for f in futures)
        assert "2 workers in parallel" in server.log.read_text()
        assert server.metric("diffbatch_workers_up") == 2
    finally:
        stop_server(server)


def test_two_workers_take_input_images_at_once_and_survive_a_kill(tmp_path: Path) -> None:
    """Many image-to-image requests at once over two workers: each lane names the input
    segments it sends apart (they once both took the same name, and a healthy worker
    answered 503), every image is the one its request gets alone, and a worker killed while
    the other takes inputs costs only its own request (its sweep once took the other's)."""
    before = set(segments("diffbatch-"))
    gate = tmp_path / "gate"
    server = start_server(
        tmp_path,
        "--data-parallel-size",
        "2",
        "--batching",
        "request",
        # tiny-sd through img2img: the cheapest model that takes an input image
        "--pipeline-class",
        "tests.pipelines.custom:GatedImageToImage",
        env=gated_env(gate),
        own_group=True,
    )
    photos = [picture(256, 256, seed) for seed in range(4)]
    assert photos[0].nbytes >= SHM_MIN_BYTES  # so each goes to its worker through shared memory
    uploads = [png_of(photo) for photo in photos]
    try:
        with (
            openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0) as client,
            ThreadPoolExecutor(25) as pool,
        ):

            def edit(seed: int, prompt: str = "a red ball", size: str = "32x32") -> np.ndarray:
                result = client.images.edit(
                    image=("photo.png", uploads[seed % 4], "image/png"),
                    prompt=prompt,
                    size=size,
                    extra_body={"seed": seed, "num_inference_steps": 2},
                )
                return pixels((result.data or [])[0].b64_json)

            together = list(pool.map(edit, range(24)))  # each one 200: an error would raise here
            for seed in range(4):  # alone, on one worker: the same image (batched: within 1/255)
                assert np.abs(edit(seed).astype(int) - together[seed]).max() <= 1
            held = pool.submit(edit, 0, "HOLD", "64x64")  # its own batch, on one worker
            wait_for(lambda: gate.with_suffix(".entered").exists(), "a worker holds the HOLD request")
            (busy,) = (int(p.suffix.rsplit("-", 1)[1]) for p in tmp_path.glob("gate.entered-*"))
            beside = [pool.submit(edit, seed) for seed in range(24)]  # the other worker takes them
            os.kill(busy, signal.SIGKILL)
            with pytest.raises(openai.InternalServerError) as raised:
                held.result(timeout=120)
            assert raised.value.status_code == 503
            assert [f.result(timeout=300).shape for f in beside] == [(32, 32, 3)] * 24
        assert server.metric("diffbatch_worker_crashes_total") == 1  # the killed one only
        # (Its restart may still be loading: the server stops it too.)
    finally:
        gate.touch()
        stop_server(server)
    assert server.process.returncode == -signal.SIGTERM  # uvicorn re-raises the signal
    assert group_left(server.process.pid) == []
    assert set(segments("diffbatch-")) <= before  # none new (orphans of dead processes may be swept)


def png_of(image: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG")
    return buffer.getvalue()
