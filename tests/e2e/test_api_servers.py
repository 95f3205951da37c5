"""Several API processes in front of one engine process (`--api-server-count 2`): a client
sees what one process answers (the official client's image equals a single-process
server's), streams with previews, a disconnect aborts the request in the engine, /metrics
adds up every process's counts, and the faults: an API process or the engine process killed
ends its requests clearly, nothing runs twice, the others serve on, and the supervisor
starts what died again.

The whole e2e suite runs this way with `DIFFBATCH_TEST_API_SERVERS=2 pytest tests/e2e`
(`bench/launch.py`); this module is what the normal suite runs of it.

Requests that must stay in the engine say HOLD: the test pipeline's prepare waits for the
gate file (`tests/pipelines/custom.py`), whatever the machine's speed.
"""

from __future__ import annotations

import asyncio
import base64
import io
import os
import re
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from bench.launch import spawn_server, wait_until_ready
from server.api_servers.api_process import API_SERVER_HEADER
from tests.e2e.conftest import Server, gated_env, group_left, stop_server
from tests.polling import until, wait_for
from tests.threads import THREADS

pytestmark = pytest.mark.slow

FLAGS = (
    "--pipeline-class",
    "tests.pipelines.custom:GatedPrepareTextToImage",
    "--num-threads",
    str(THREADS),
    "--deadline-admission",
    "off",
)
IMAGE = {"prompt": "a red square", "size": "64x64"}
PARAMS = {"seed": 11, "num_inference_steps": 2}
ABORTED = "diffbatch_requests_aborted_total"


@pytest.fixture(scope="module")
def gate(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gate") / "open"


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory, gate: Path) -> Iterator[tuple[Server, Server]]:
    """Two API processes over one engine process, and one process for comparison (both
    loading at once)."""
    env = gated_env(gate)
    several = spawn_server(
        tmp_path_factory.mktemp("several"), *FLAGS, "--api-server-count", "2", env=env, own_group=True
    )
    single = spawn_server(tmp_path_factory.mktemp("single"), *FLAGS, "--api-server-count", "1", env=env)
    try:
        wait_until_ready(several, 240)
        wait_until_ready(single, 240)
        yield several, single
    finally:
        stop_server(several)
        stop_server(single)


@pytest.fixture(scope="module")
def several(servers: tuple[Server, Server]) -> Server:
    return servers[0]


def client_for(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0)


def pixels(b64: str | None) -> np.ndarray:
    assert b64 is not None
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))))


def pid_of(server: Server, who: str) -> int:
    """The pid the supervisor last logged for `who` ("engine process", "API server 1")."""
    found = re.findall(rf"{who} started \(pid (\d+)\)", server.log.read_text())
    assert found, f"the supervisor logged no start of {who}"
    return int(found[-1])


def metric_or_none(server: Server, prefix: str) -> float | None:
    try:
        return server.metric(prefix)
    except (AssertionError, httpx.HTTPError):  # the engine process is away: no live gauges
        return None


def idle(server: Server) -> bool:
    waiting = metric_or_none(server, "diffbatch_num_requests_waiting")
    running = metric_or_none(server, "diffbatch_num_requests_running")
    return waiting == 0 and running == 0


@contextmanager
def holding(server: Server, gate: Path) -> Iterator[Path]:
    """HOLD requests wait in the engine until the block ends; then the gate opens, the
    engine empties, and the gate is armed again for the next test. Yields the file the
    pipeline touches as it prepares a HOLD request (left after the block: a test that
    removed it sees whether a HOLD request ran again)."""
    entered = gate.with_suffix(".entered")
    entered.unlink(missing_ok=True)
    try:
        yield entered
    finally:
        gate.touch()
        wait_for(lambda: idle(server), "the engine emptied", timeout_s=240)
        gate.unlink()


def test_the_official_client_gets_the_image_one_process_makes(servers: tuple[Server, Server]) -> None:
    images = []
    for server in servers:
        with client_for(server) as client:
            result = client.images.generate(prompt="a red square", size="64x64", extra_body=PARAMS)
        images.append(pixels((result.data or [])[0].b64_json))
    assert images[0].shape == (64, 64, 3)
    assert (images[0] == images[1]).all()


def test_a_stream_brings_its_previews_across_the_boundary(servers: tuple[Server, Server]) -> None:
    several, single = servers
    body = {"seed": 7, "num_inference_steps": 6}
    with client_for(several) as client:
        stream = client.images.generate(
            prompt="a red square", size="64x64", stream=True, partial_images=2, extra_body=body
        )
        events = list(stream)
    with client_for(single) as client:
        alone = client.images.generate(prompt="a red square", size="64x64", extra_body=body)
    assert [e.type for e in events] == ["image_generation.partial_image"] * 2 + ["image_generation.completed"]
    assert (pixels(events[-1].b64_json) == pixels((alone.data or [])[0].b64_json)).all()


def test_metrics_add_up_the_api_processes_and_show_the_engine_once(several: Server) -> None:
    models = 'diffbatch_requests_total{endpoint="/v1/models",status="200"}'
    before = several.labelled_count(models)
    with client_for(several) as client:
        client.images.generate(prompt="a red square", size="64x64", extra_body=PARAMS)
    answered: set[str] = set()
    sent = 0
    while answered != {"0", "1"} and sent < 500:  # a new connection each: the kernel picks a process
        response = httpx.get(f"{several.v1}/models")
        assert response.status_code == 200
        answered.add(response.headers[API_SERVER_HEADER])
        sent += 1
    assert answered == {"0", "1"}, "one API process took every connection"
    for _ in range(4):  # each scrape is answered by either process: each adds up both
        text = httpx.get(f"{several.url}/metrics").text
        assert f"{models} {float(before + sent)}" in text
        assert text.count("# TYPE diffbatch_num_requests_waiting gauge") == 1  # the engine's, once
        assert text.count("# TYPE diffbatch_batch_size histogram") == 1
    assert several.metric("diffbatch_batch_size_count") >= 1  # counted in the engine process


def test_a_client_that_goes_away_aborts_its_request_in_the_engine(several: Server, gate: Path) -> None:
    before = several.metric(ABORTED)

    async def abandon(entered: Path) -> None:
        async with httpx.AsyncClient(timeout=120) as http:
            request = asyncio.create_task(
                http.post(f"{several.v1}/images/generations", json={**IMAGE, "prompt": "HOLD abandoned"})
            )
            await until(entered.exists, "the request held in the pipeline")
            request.cancel()  # the connection closes under the server

    with holding(several, gate) as entered:
        asyncio.run(abandon(entered))
        wait_for(lambda: several.metric(ABORTED) == before + 1, "the engine aborted the request")


def test_a_killed_api_process_ends_its_requests_and_is_started_again(several: Server, gate: Path) -> None:
    before = several.metric(ABORTED)
    with holding(several, gate) as entered, httpx.Client(timeout=120) as http:
        body = {**IMAGE, "prompt": "HOLD killed api", "stream": True, "partial_images": 1}
        with http.stream("POST", f"{several.v1}/images/generations", json=body) as response:
            assert response.status_code == 200
            index = response.headers[API_SERVER_HEADER]
            wait_for(entered.exists, "the engine holds the request")
            killed = pid_of(several, f"API server {index}")
            os.kill(killed, signal.SIGKILL)
            with pytest.raises(httpx.HTTPError):  # its connection died with its process
                response.read()
        # The engine process dropped what the dead process had sent.
        wait_for(lambda: several.metric(ABORTED) == before + 1, "the engine aborted the request")
        entered.unlink()
    assert not entered.exists()  # once the engine was free again, the request ran nowhere else
    assert several.metric(ABORTED) == before + 1
    with client_for(several) as client:  # the other API process serves on
        assert client.images.generate(prompt="a red square", size="64x64", extra_body=PARAMS).data
    wait_for(lambda: pid_of(several, f"API server {index}") != killed, "the supervisor restarted it")


def test_a_killed_engine_process_ends_requests_with_503_and_is_started_again(
    several: Server, gate: Path
) -> None:
    with holding(several, gate) as entered, ThreadPoolExecutor(1) as pool:
        held = pool.submit(
            httpx.post,
            f"{several.v1}/images/generations",
            json={**IMAGE, "prompt": "HOLD killed engine"},
            timeout=120,
        )
        wait_for(entered.exists, "the engine holds the request")
        killed = pid_of(several, "engine process")
        entered.unlink()
        os.kill(killed, signal.SIGKILL)
        response = held.result(timeout=120)
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "engine_restarting"
        wait_for(lambda: pid_of(several, "engine process") != killed, "the supervisor restarted it")
        wait_for(lambda: httpx.get(f"{several.url}/health").status_code == 200, "the engine is back", 240)
        with client_for(several) as client:
            assert client.images.generate(prompt="a red square", size="64x64", extra_body=PARAMS).data
        assert not entered.exists()  # the new engine did not run the lost request again


def test_a_supervisor_killed_alone_stops_its_server_as_sigterm_does(several: Server, gate: Path) -> None:
    """Last in this module: it ends the server. Its children see the supervisor gone and
    stop as on SIGTERM: the request in flight is answered (the engine process waits for the
    API processes to drain) and no process of the server is left."""
    entered = gate.with_suffix(".entered")
    entered.unlink(missing_ok=True)
    gate.unlink(missing_ok=True)
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(
            httpx.post, f"{several.v1}/images/generations", json={**IMAGE, "prompt": "HOLD"}, timeout=120
        )
        wait_for(entered.exists, "the engine holds the request")
        several.process.kill()
        several.process.wait()
        wait_for(lambda: "the supervisor is gone" in several.log.read_text(), "the engine process saw it")
        gate.touch()
        response = held.result(timeout=120)
    assert response.status_code == 200, response.text
    wait_for(lambda: group_left(several.process.pid) == [], "every process of the server ended")
