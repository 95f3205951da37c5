"""Traces in-process (the real app and engine over a fake pipeline, request-level batching):
sampling as a caller's `traceparent` and `--otlp-traces-sample-ratio` decide, OTLP over gRPC,
and the flag's URL and protocol. The whole server, OTLP over HTTP and step-level stages from a
worker process: tests/e2e/test_traces.py."""

from __future__ import annotations

import secrets
import subprocess
import sys

import pytest

from server.settings import SettingsError, load_settings
from server.tracing.endpoint import exporter_endpoint, trace_protocol
from tests.otlp_receiver import otlp_grpc_receiver, otlp_receiver
from tests.server.conftest import ClientFactory

ROUTE = "POST /v1/images/generations"
BODY = {"prompt": "a cat", "size": "64x64"}


@pytest.fixture(autouse=True)
def _export_soon(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "10")  # the SDK's own setting, in ms


def traceparent(sampled: bool) -> tuple[str, str]:
    trace_id = secrets.token_hex(16)
    return trace_id, f"00-{trace_id}-{secrets.token_hex(8)}-{'01' if sampled else '00'}"


async def test_a_zero_ratio_traces_only_what_a_caller_sampled(make_client: ClientFactory) -> None:
    with otlp_receiver() as receiver:
        client = await make_client(otlp_traces_endpoint=receiver.url, otlp_traces_sample_ratio=0.0)
        _, unsampled = traceparent(sampled=False)
        for headers in ({"traceparent": unsampled}, {}):
            assert (
                await client.post("/v1/images/generations", json=BODY, headers=headers)
            ).status_code == 200
        trace_id, sampled = traceparent(sampled=True)
        response = await client.post("/v1/images/generations", json=BODY, headers={"traceparent": sampled})
        assert response.status_code == 200
        spans = receiver.wait_for_spans(trace_id, {ROUTE, "engine", "queue wait", "forward", "encode"})
        # Exports keep the order spans ended in: the two earlier requests' would be here by now.
        assert {span.trace_id for span in receiver.spans} == {trace_id}
    forward = spans["forward"]
    assert forward.parent_id == spans["engine"].span_id
    assert forward.attributes["diffbatch.batch_size"] == 1
    assert spans["engine"].attributes["diffbatch.request_id"] == response.headers["x-request-id"]


async def test_traces_go_over_grpc_for_a_grpc_url(make_client: ClientFactory) -> None:
    with otlp_grpc_receiver() as receiver:
        client = await make_client(otlp_traces_endpoint=receiver.url)
        trace_id, header = traceparent(sampled=True)
        response = await client.post("/v1/images/generations", json=BODY, headers={"traceparent": header})
        assert response.status_code == 200
        spans = receiver.wait_for_spans(trace_id, {ROUTE, "engine", "forward"})
    assert spans["engine"].parent_id == spans[ROUTE].span_id


async def test_health_checks_are_not_traced(make_client: ClientFactory) -> None:
    with otlp_receiver() as receiver:
        client = await make_client(otlp_traces_endpoint=receiver.url)
        assert (await client.get("/health")).status_code == 200
        trace_id, header = traceparent(sampled=True)
        await client.post("/v1/images/generations", json=BODY, headers={"traceparent": header})
        receiver.wait_for_spans(trace_id, {ROUTE, "engine"})
        assert all(span.trace_id == trace_id for span in receiver.spans)


@pytest.mark.parametrize(
    ("endpoint", "protocol", "environ", "expected"),
    [
        (
            "http://collector:4318/v1/traces",
            None,
            {},
            ("http/protobuf", "http://collector:4318/v1/traces", True),
        ),
        ("https://collector", None, {}, ("http/protobuf", "https://collector/v1/traces", False)),
        ("grpc://collector:4317", None, {}, ("grpc", "http://collector:4317", True)),
        ("grpcs://collector:4317", None, {}, ("grpc", "https://collector:4317", False)),
        ("http://collector:4317", "grpc", {}, ("grpc", "http://collector:4317", True)),
        (
            "http://collector:4317",
            None,
            {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"},
            ("grpc", "http://collector:4317", True),
        ),
    ],
)
def test_the_endpoint_says_the_protocol_and_the_exporters_url(
    endpoint: str, protocol: str | None, environ: dict[str, str], expected: tuple[str, str, bool]
) -> None:
    resolved = trace_protocol(endpoint, protocol, environ)  # type: ignore[arg-type]
    assert (resolved, *exporter_endpoint(endpoint, resolved)) == expected


@pytest.mark.parametrize("endpoint", ["collector:4318", "ftp://collector/v1/traces", "http:///v1/traces"])
def test_an_endpoint_that_is_not_a_collector_url_is_refused(endpoint: str) -> None:
    with pytest.raises(SettingsError, match="otlp_traces_endpoint"):
        load_settings(None, {"otlp_traces_endpoint": endpoint}, {})


def test_without_the_flag_the_sdk_is_never_imported() -> None:
    """A fresh interpreter: the app as `diffbatch serve` makes it, a traced request's settings
    parsed too; the SDK (and its exporters) only comes with the flag."""
    script = (
        "import sys\n"
        "from server.app import create_app\n"
        "from server.settings import ServeSettings\n"
        "create_app(ServeSettings())\n"
        "sdk = ('opentelemetry.sdk', 'opentelemetry.exporter')\n"
        "print(sorted(m for m in sys.modules if m.startswith(sdk)))\n"
        "create_app(ServeSettings(otlp_traces_endpoint='http://127.0.0.1:9/v1/traces'))\n"
        "print('opentelemetry.sdk.trace' in sys.modules)\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    assert run.stdout.splitlines() == ["[]", "True"]
