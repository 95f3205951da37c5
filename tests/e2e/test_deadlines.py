"""Deadlines against a real server with the official client: behind long work, a request
whose API key's SLO cannot be met is refused at once (429, Retry-After, the estimate), and
one whose SLO can be met is served.

The long work is a held request of 900 steps (the gate never opens); the step time is the
server's own measurement of an earlier request. The hurried key's one-step request within
its 5 s SLO is refused as a retry that would fit once the work ahead is done, on any machine
where a tiny-sd step (its encode and decode included, as request-level forwards are timed)
takes between 6 ms and 5 s; on this CPU one takes tens to hundreds of milliseconds."""

from __future__ import annotations

import re
import threading
from pathlib import Path

import httpx
import openai
import pytest

from tests.e2e.conftest import Server, gated_env, start_server, stop_server
from tests.polling import wait_for

pytestmark = pytest.mark.slow

# The bulk key waits for its long work as long as it takes (its estimate is far from exact).
KEYS = "hurried:slo=5, patient:slo=600, bulk:slo=1000000"
TWO_STEPS = {"num_inference_steps": 2}


def metric(server: Server, line_prefix: str) -> float:
    text = httpx.get(f"{server.url}/metrics", headers={"Authorization": "Bearer bulk"}).text
    for line in text.splitlines():
        if line.startswith(line_prefix):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no metric line starts with {line_prefix!r}")


def client(server: Server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key=key, max_retries=0, timeout=120)


def test_behind_long_work_a_deadline_that_cannot_be_met_is_refused_one_that_can_is_served(
    tmp_path: Path,
) -> None:
    server = start_server(
        tmp_path,
        "--pipeline-class",
        "tests.pipelines.custom:GatedTextToImage",
        "--batching",
        "request",
        "--request-batch-max-wait-ms",
        "0",
        "--api-key",
        KEYS,
        "--max-request-work",  # room for the long work's 900 steps
        "4000000",
        "--shutdown-timeout-s",  # the held work never ends: stop without draining it
        "1",
        env=gated_env(tmp_path / "gate"),
    )
    try:
        with client(server, "bulk") as bulk, client(server, "patient") as patient:
            for _ in range(2):  # the warm-up, then the step time measured
                bulk.images.generate(prompt="a red circle", extra_body=TWO_STEPS)
            served = patient.images.generate(prompt="a blue square", extra_body=TWO_STEPS)
            assert served.data is not None and served.data[0].b64_json
            held: list[BaseException] = []
            long_work = threading.Thread(target=_run_held, args=(bulk, held), daemon=True)
            long_work.start()
            wait_for(
                lambda: bool(held) or metric(server, "diffbatch_num_requests_running") >= 1,
                "the long request runs",
            )
            assert not held, held
        with client(server, "hurried") as hurried, pytest.raises(openai.RateLimitError) as refused:
            hurried.images.generate(prompt="a green triangle", extra_body={"num_inference_steps": 1})
        response = refused.value.response
        assert response.status_code == 429 and int(response.headers["retry-after"]) >= 1
        assert response.headers["x-should-retry"] == "true"  # after the work ahead, it would fit
        error = response.json()["error"]
        assert error["code"] == "deadline_unmeetable"
        assert "would finish in about" in error["message"]
        assert re.search(r"deadline is in [45]\.\d s", error["message"]), error["message"]
        assert metric(server, 'diffbatch_requests_refused_total{reason="deadline_unmeetable"}') == 1
        assert metric(server, "diffbatch_num_requests_waiting") == 0  # never queued
        assert metric(server, "diffbatch_requests_aborted_total") == 0
    finally:
        stop_server(server)


def _run_held(bulk: openai.OpenAI, errors: list[BaseException]) -> None:
    """The long work: 900 steps (tiny-sd takes at most 999), held before its first."""
    try:
        bulk.images.generate(prompt="HOLD", extra_body={"num_inference_steps": 900})
    except openai.APIStatusError as error:
        errors.append(error)  # refused: the test says so instead of waiting for it to run
    except openai.OpenAIError:
        pass  # the server stops under it
