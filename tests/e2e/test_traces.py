"""Traces end to end: `diffbatch serve --otlp-traces-endpoint` (tiny-sd, step-level batching,
the pipeline in a worker process, whose stage timings must come back to the server) sending
OTLP over HTTP to an in-process receiver that decodes each export with opentelemetry-proto's
own classes. A request continues its caller's `traceparent`, with a span per stage; two
requests that shared denoising steps each keep a trace of their own. Without the flag
nothing is sent, whatever the environment asks of OpenTelemetry."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import Server, start_server, stop_server
from tests.e2e.sharing import sent_together
from tests.otlp_receiver import ReceivedSpan, Receiver, otlp_receiver

pytestmark = pytest.mark.slow

ROUTE = "POST /v1/images/generations"
ENGINE_STAGES = {"queue wait", "prompt encode", "denoise", "decode"}


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    with otlp_receiver() as receiver:
        yield receiver


@pytest.fixture(scope="module")
def server(receiver: Receiver, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    instance = start_server(
        tmp_path_factory.mktemp("traces"),
        "--executor",
        "process",
        "--deadline-admission",
        "off",
        "--otlp-traces-endpoint",
        receiver.url,
        env={"OTEL_BSP_SCHEDULE_DELAY": "50"},  # the SDK's own setting: export within 50 ms
    )
    yield instance
    stop_server(instance)


def traceparent() -> tuple[str, str, str]:
    """A caller's trace id, span id and the `traceparent` that names them (sampled)."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return trace_id, span_id, f"00-{trace_id}-{span_id}-01"


def generate(server: Server, header: str, **fields: object) -> httpx.Response:
    body = {"prompt": "a red circle", "size": "64x64", "num_inference_steps": 4, **fields}
    response = httpx.post(
        f"{server.v1}/images/generations", json=body, headers={"traceparent": header}, timeout=120
    )
    response.raise_for_status()
    return response


def within(child: ReceivedSpan, parent: ReceivedSpan) -> bool:
    return parent.start_ns <= child.start_ns <= child.end_ns <= parent.end_ns


def test_a_request_continues_its_callers_trace_with_a_span_per_stage(
    server: Server, receiver: Receiver
) -> None:
    trace_id, caller, header = traceparent()
    response = generate(server, header, response_format="url")
    spans = receiver.wait_for_spans(trace_id, {ROUTE, "engine", *ENGINE_STAGES, "encode", "upload"})
    request = spans[ROUTE]
    assert request.parent_id == caller and request.service == "diffbatch"
    assert request.attributes["http.response.status_code"] == 200
    engine = spans["engine"]
    assert engine.parent_id == request.span_id
    assert engine.attributes["diffbatch.request_id"] == response.headers["x-request-id"]
    for name in ENGINE_STAGES:
        assert spans[name].parent_id == engine.span_id, name
        assert within(spans[name], engine), name
    for name in ("encode", "upload"):  # the server's own stages, after the engine's
        assert spans[name].parent_id == request.span_id, name
        assert spans[name].start_ns >= spans["decode"].end_ns, name
    assert spans["queue wait"].end_ns <= spans["prompt encode"].start_ns
    assert spans["prompt encode"].end_ns <= spans["denoise"].start_ns
    assert spans["denoise"].end_ns <= spans["decode"].start_ns
    denoise = spans["denoise"].attributes
    assert denoise["diffbatch.steps"] == 4
    assert denoise["diffbatch.group_size.min"] == denoise["diffbatch.group_size.max"] == 1
    assert engine.attributes["diffbatch.preemptions"] == 0
    assert engine.attributes["diffbatch.priority"] == 0


def test_requests_that_shared_steps_each_have_a_trace_of_their_own(
    server: Server, receiver: Receiver
) -> None:
    def send_two() -> list[tuple[str, httpx.Response]]:
        callers = [traceparent() for _ in range(2)]
        with ThreadPoolExecutor(2) as pool:
            sent = [
                pool.submit(generate, server, header, prompt=f"cat {i}")
                for i, (_, _, header) in enumerate(callers)
            ]
            return [
                (trace_id, future.result()) for (trace_id, _, _), future in zip(callers, sent, strict=True)
            ]

    sent = sent_together(server, send_two)
    engines = []
    for trace_id, response in sent:
        spans = receiver.wait_for_spans(trace_id, {ROUTE, "engine", *ENGINE_STAGES})
        # One engine span per trace: the shared steps did not merge the two requests' traces.
        assert [s.name for s in receiver.trace(trace_id)].count("engine") == 1
        engine = spans["engine"]
        assert engine.parent_id == spans[ROUTE].span_id
        assert engine.attributes["diffbatch.request_id"] == response.headers["x-request-id"]
        assert spans["denoise"].attributes["diffbatch.group_size.max"] == 2
        engines.append(engine)
    assert engines[0].trace_id != engines[1].trace_id


def test_without_the_flag_nothing_is_sent(tmp_path: Path) -> None:
    with otlp_receiver() as receiver:
        # What would make OpenTelemetry set up from the environment send: an endpoint, and
        # FastAPI's own export asked for (FastAPI 0.165 traces requests natively).
        env = {
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver.url,
            "FASTAPI_OTEL_AUTO_CONFIGURE": "true",
            "OTEL_BSP_SCHEDULE_DELAY": "10",
        }
        server = start_server(tmp_path, "--batching", "request", env=env)
        try:
            generate(server, traceparent()[2])
        finally:
            stop_server(server)  # a graceful stop: what any span processor held is sent now
        assert "Application shutdown complete" in server.log.read_text()
        assert receiver.exports == 0
