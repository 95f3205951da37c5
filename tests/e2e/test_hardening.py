"""Failures and impatient clients against a real server whose pipeline a test can hold
(`tests.pipelines.custom:GatedTextToImage`: a HOLD prompt waits for a gate file, a FAIL
prompt raises), so nothing here depends on how fast the machine is."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from tests.e2e.conftest import Server, gated_env, start_server, stop_server
from tests.polling import until, wait_for

pytestmark = pytest.mark.slow

FAST = {"num_inference_steps": 2}
GENERATIONS = 'diffbatch_requests_total{endpoint="/v1/images/generations",status="'


@pytest.fixture(scope="module")
def gated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Path]]:
    server, gate = start_gated(tmp_path_factory.mktemp("gated"))
    yield server, gate
    gate.touch()
    stop_server(server)


def count(server: Server, status: int) -> float:
    return server.labelled_count(f'{GENERATIONS}{status}"}}')


def test_24_clients_that_give_up_while_queued_never_run_and_are_no_error(gated: tuple[Server, Path]) -> None:
    server, gate = gated
    gate.unlink(missing_ok=True)
    aborted_before = server.metric("diffbatch_requests_aborted_total")
    forwards_before = server.metric("diffbatch_batch_size_count")
    errors_before, gone_before = count(server, 500), count(server, 499)

    async def give_up(client: httpx.AsyncClient, i: int) -> None:
        # Another size than the held request: it can only wait, until its client gives up.
        with pytest.raises(httpx.ReadTimeout):
            body = {"prompt": f"queued {i}", "size": "32x32", **FAST}
            await client.post("/images/generations", json=body, timeout=1.0)

    async def scenario() -> httpx.Response:
        async with httpx.AsyncClient(base_url=server.v1, timeout=120) as client:
            held = asyncio.create_task(client.post("/images/generations", json={"prompt": "HOLD", **FAST}))
            await until(lambda: server.metric("diffbatch_num_requests_running") >= 1, "the held request runs")
            await asyncio.gather(*(give_up(client, i) for i in range(24)))
            await until(
                lambda: server.metric("diffbatch_requests_aborted_total") >= aborted_before + 24,
                "the 24 queued requests are aborted",
            )
            gate.touch()
            return await held

    assert asyncio.run(scenario()).status_code == 200
    assert server.metric("diffbatch_requests_aborted_total") - aborted_before == 24
    assert server.metric("diffbatch_batch_size_count") - forwards_before == 1  # only the held one ran
    assert server.metric("diffbatch_num_requests_waiting") == 0
    # Each client that left is a 499, logged once at info: no error, no traceback, no 5xx.
    wait_for(lambda: count(server, 499) >= gone_before + 24, "24 499s are counted")  # as each handler ends
    assert count(server, 500) == errors_before
    log = server.log.read_text()
    assert "client went away" in log and " ERROR " not in log and "Traceback" not in log
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_a_doomed_request_runs_once_with_the_official_clients_retries(gated: tuple[Server, Path]) -> None:
    server, gate = gated
    gate.touch()
    failures_before = server.metric("diffbatch_forward_failures_total")
    errors_before = count(server, 500)
    with openai.OpenAI(base_url=server.v1, api_key="unused") as client:  # default max_retries=2
        assert client.max_retries == 2
        with pytest.raises(openai.InternalServerError) as raised:
            client.images.generate(prompt="FAIL", extra_body=FAST)
    assert raised.value.response.headers["x-should-retry"] == "false"
    assert count(server, 500) - errors_before == 1
    assert server.metric("diffbatch_forward_failures_total") - failures_before == 1


def start_gated(workdir: Path, *flags: str) -> tuple[Server, Path]:
    gate = workdir / "gate"
    server = start_server(
        workdir,
        "--pipeline-class",
        "tests.pipelines.custom:GatedTextToImage",
        *flags,
        env=gated_env(gate),
    )
    return server, gate


def load(server: Server, pool: ThreadPoolExecutor) -> list[Future[httpx.Response]]:
    """A held request running and three of other sizes queued behind it."""
    url = f"{server.v1}/images/generations"
    bodies = [{"prompt": "HOLD", **FAST}] + [
        {"prompt": "queued", "size": f"{side}x{side}", **FAST} for side in (32, 40, 48)
    ]
    futures = []
    for body in bodies:
        futures.append(pool.submit(httpx.post, url, json=body, timeout=120))
        if body["prompt"] == "HOLD":
            wait_for(lambda: server.metric("diffbatch_num_requests_running") >= 1, "the held request runs")
    wait_for(lambda: server.metric("diffbatch_num_requests_waiting") >= 3, "three requests queue")
    return futures


def test_sigterm_lets_work_in_flight_finish_within_the_timeout(tmp_path: Path) -> None:
    server, gate = start_gated(tmp_path, "--shutdown-timeout-s", "60")
    try:
        with ThreadPoolExecutor(4) as pool:
            futures = load(server, pool)
            server.process.send_signal(signal.SIGTERM)
            gate.touch()  # the held request can finish now; the queued ones run after it
            statuses = [future.result(timeout=120).status_code for future in futures]
            server.process.wait(timeout=60)
    finally:
        stop_server(server)
    assert statuses == [200, 200, 200, 200]


def test_sigterm_answers_what_cannot_finish_with_503_and_exits_in_time(tmp_path: Path) -> None:
    server, _ = start_gated(tmp_path, "--shutdown-timeout-s", "4")  # the gate never opens
    try:
        with ThreadPoolExecutor(4) as pool:
            futures = load(server, pool)
            started = time.monotonic()
            server.process.send_signal(signal.SIGTERM)
            responses = [future.result(timeout=120) for future in futures]
            server.process.wait(timeout=60)
            stopped_after = time.monotonic() - started
    finally:
        stop_server(server)
    assert [r.status_code for r in responses] == [503] * 4
    assert all(r.headers["x-should-retry"] == "true" for r in responses)
    # The timeout, then an interrupted step and the exit: well under the minute a server that
    # ignored its timeout would take (the gate never opens), with room for a loaded machine.
    assert stopped_after < 4 + 30
    assert server.process.returncode in (0, -signal.SIGTERM)
    assert "did not finish in time" in server.log.read_text()


def test_a_request_past_its_deadline_reaches_the_pipeline_once(tmp_path: Path) -> None:
    server, _ = start_gated(tmp_path, "--request-timeout-s", "2")  # the gate never opens
    try:
        with (
            openai.OpenAI(base_url=server.v1, api_key="unused", timeout=60) as client,  # 2 retries
            pytest.raises(openai.InternalServerError) as raised,
        ):
            client.images.generate(prompt="HOLD", extra_body=FAST)
        assert raised.value.status_code == 504 and raised.value.response.headers["x-should-retry"] == "false"
        assert count(server, 504) == 1  # not three
        assert server.metric("diffbatch_batch_size_count") == 1  # one forward, interrupted
        assert server.metric("diffbatch_forwards_interrupted_total") == 1
    finally:
        stop_server(server)
