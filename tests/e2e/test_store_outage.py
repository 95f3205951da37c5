"""Fault injection against a real PostgreSQL: the backends of a real `diffbatch serve` are
stopped with SIGSTOP (frozen but connected, as a frozen VM or a pooler waiting for a
connection would be) for 15 seconds. Meanwhile job routes answer 503 within the deadline
plus a second, `/health` answers and names the job store, images are still made; a video
that finishes during the outage ends `completed` once the database is back, with its webhook.
"""

from __future__ import annotations

import base64
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psycopg
import pytest
from standardwebhooks import Webhook

from bench.launch import ServerProcess
from tests.e2e.conftest import gated_env, start_server, stop_server
from tests.polling import wait_for
from tests.postgres import Cluster
from tests.webhook_receiver import webhook_receiver

pytestmark = [pytest.mark.slow]

DEADLINE_S = 2.0  # --database-timeout-s
OUTAGE_S = 15.0
SECRET = "whsec_" + base64.b64encode(os.urandom(24)).decode()

MODELS = """\
models:
  - name: img
    model: tiny-sd
    preload: true
  - name: vid
    model: tiny-wan
    pipeline_class: tests.pipelines.custom:GatedWanTextToVideo
    batching: request
    preload: true
"""


def backends(url: str) -> list[int]:
    """The PostgreSQL processes serving diffbatch's connections."""
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE application_name = 'diffbatch'"
        ).fetchall()
    return [row[0] for row in rows]


def signal_all(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        os.kill(pid, sig)


def timed(call: str, url: str, **kwargs: object) -> tuple[httpx.Response, float]:
    began = time.monotonic()
    response = httpx.request(call, url, timeout=60, **kwargs)  # type: ignore[arg-type]
    return response, time.monotonic() - began


def refused_in_time(response: httpx.Response, took_s: float) -> bool:
    error = response.json().get("error") or {}
    return (
        response.status_code == 503
        and error.get("code") == "job_store_unavailable"
        and took_s < DEADLINE_S + 1
    )


@pytest.fixture
def served(
    tmp_path: Path, postgres_cluster: Cluster
) -> Iterator[tuple[ServerProcess, str, Path, list[object]]]:
    config = tmp_path / "models.yaml"
    config.write_text(MODELS)
    gate = tmp_path / "gate"
    url = postgres_cluster.create_database("store_outage")
    with webhook_receiver() as hook:
        server = start_server(
            tmp_path,
            "--config",
            str(config),
            "--database-url",
            url,
            "--database-timeout-s",
            str(DEADLINE_S),
            "--webhook-url",
            hook.url,
            config=None,
            env={**gated_env(gate), "DIFFBATCH_WEBHOOK_SECRET": SECRET},
        )
        try:
            yield server, url, gate, hook.received  # type: ignore[misc]
        finally:
            gate.touch()
            stop_server(server)


def test_a_frozen_database_stalls_nothing_and_loses_no_video(
    served: tuple[ServerProcess, str, Path, list[object]],
) -> None:
    server, url, gate, received = served
    job = httpx.post(f"{server.v1}/videos", json={"model": "vid", "prompt": "HOLD", "seconds": 1}).json()
    wait_for(
        lambda: httpx.get(f"{server.v1}/videos/{job['id']}").json()["status"] == "in_progress", "running"
    )
    frozen = backends(url)
    assert frozen, "no backend of diffbatch in pg_stat_activity"
    signal_all(frozen, signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        gate.touch()  # the video finishes during the outage
        wait_for(
            lambda: (
                f"video {job['id']} is completed, but the job store cannot record it"
                in server.log.read_text()
            ),
            "the finished video's completion refused by the frozen database",
        )
        for method, path, body in (
            ("GET", f"/videos/{job['id']}", None),
            ("GET", "/videos", None),
            ("POST", "/videos", {"model": "vid", "prompt": "another", "seconds": 1}),
        ):
            response, took_s = timed(method, f"{server.v1}{path}", json=body)
            assert refused_in_time(response, took_s), (method, path, response.text, took_s)
        health, took_s = timed("GET", f"{server.url}/health")
        assert health.status_code == 200 and took_s < 1.0
        assert health.json()["degraded"]["job_store"]["status"] == "unavailable"
        image = {"model": "img", "prompt": "a red square", "size": "64x64", "num_inference_steps": 2}
        made, _ = timed("POST", f"{server.v1}/images/generations", json=image)
        assert made.status_code == 200 and made.json()["data"][0]["b64_json"]
        # With an Idempotency-Key the request needs the store: refused like a job route.
        keyed, took_s = timed(
            "POST", f"{server.v1}/images/generations", json=image, headers={"Idempotency-Key": "k1"}
        )
        assert refused_in_time(keyed, took_s), keyed.text
        assert received == [] and httpx.get(f"{server.url}/health").status_code == 200
        time.sleep(max(0.0, OUTAGE_S - (time.monotonic() - stopped_at)))  # the outage lasts its 15 s
    finally:
        signal_all(frozen, signal.SIGCONT)
    wait_for(
        lambda: httpx.get(f"{server.v1}/videos/{job['id']}").json().get("status") == "completed",
        "the video completed once the database is back",
    )
    wait_for(lambda: len(received) == 1, "its webhook delivered")
    event = Webhook(SECRET).verify(received[0].body, received[0].headers)  # type: ignore[attr-defined]
    assert event["type"] == "video.completed" and event["data"] == {"id": job["id"]}
    assert httpx.get(f"{server.v1}/videos/{job['id']}/content").content.startswith(b"\x00\x00\x00")
    wait_for(lambda: "degraded" not in httpx.get(f"{server.url}/health").json(), "/health whole again")
