"""Abandoned work stops: a real server in request-level batching interrupts a long forward
whose client went away, and SIGTERM does not wait for a long forward to finish.

Nothing here depends on how fast the machine is: the long request (999 steps at 256x256)
takes minutes on this CPU if it is not interrupted, and the tests wait for the server's
own counters, never for a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import Server, start_server, stop_server
from tests.polling import until

pytestmark = pytest.mark.slow

# Far above the default work budget, on purpose.
LONG = {"prompt": "long", "size": "256x256", "num_inference_steps": 999}
# Request-level batching: what is interrupted here is one long pipeline forward (step mode
# drops an abandoned request at the next step: tests/engine/core/test_step_engine.py).
FLAGS = (
    "--batching",
    "request",
    "--max-request-work",
    str(10**15),
    "--shutdown-timeout-s",
    "2",
    "--num-threads",
    "1",
)


def wait_for_metric(server: Server, name: str, at_least: float, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while server.metric(name) < at_least:
        assert time.monotonic() < deadline, f"{name} never reached {at_least}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def long_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(tmp_path_factory.mktemp("interrupts"), *FLAGS)
    yield server
    stop_server(server)


def test_a_client_that_disconnects_frees_the_engine_at_the_next_step(long_server: Server) -> None:
    interrupted_before = long_server.metric("diffbatch_forwards_interrupted_total")

    async def abandon() -> None:
        async with httpx.AsyncClient(base_url=long_server.v1, timeout=600) as client:
            request = asyncio.create_task(client.post("/images/generations", json=LONG))
            await until(lambda: long_server.metric("diffbatch_num_requests_running") >= 1, "the request runs")
            request.cancel()  # the client goes away mid-forward
            await asyncio.gather(request, return_exceptions=True)

    asyncio.run(abandon())
    wait_for_metric(long_server, "diffbatch_forwards_interrupted_total", interrupted_before + 1)
    after = httpx.post(
        f"{long_server.v1}/images/generations", json={"prompt": "next", "num_inference_steps": 2}, timeout=120
    )
    assert after.status_code == 200
    log = long_server.log.read_text()
    # The client that left is no error: logged at info, no traceback.
    assert "interrupted" in log and " ERROR " not in log and "Traceback" not in log


def test_sigterm_during_a_long_forward_exits_within_the_shutdown_timeout(tmp_path: Path) -> None:
    server = start_server(tmp_path, *FLAGS)
    with ThreadPoolExecutor(1) as pool:
        try:
            outcome = pool.submit(httpx.post, f"{server.v1}/images/generations", json=LONG, timeout=600)
            wait_for_metric(server, "diffbatch_num_requests_running", 1)
            started = time.monotonic()
            server.process.send_signal(signal.SIGTERM)
            # 2 s for requests in flight, then the forward stops at its next step.
            server.process.wait(timeout=60)
            stopped_after = time.monotonic() - started
        finally:
            stop_server(server)
        with contextlib.suppress(httpx.HTTPError):
            outcome.result(timeout=60)  # an error answer or a closed connection
    # uvicorn ends a clean shutdown by re-raising the signal it caught.
    assert server.process.returncode in (0, -signal.SIGTERM) and stopped_after < 30
    assert "interrupted" in server.log.read_text()
