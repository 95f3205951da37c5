"""An OTLP trace receiver for the tests: a small server on loopback that decodes each export
(`ExportTraceServiceRequest`, with opentelemetry-proto's own classes) into plain spans —
over HTTP (`otlp_receiver`) or gRPC (`otlp_grpc_receiver`) — as a collector would see them."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from tests.polling import wait_for


@dataclass(frozen=True)
class ReceivedSpan:
    name: str
    trace_id: str  # hex, as in a traceparent
    span_id: str
    parent_id: str  # "" for a root span
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    service: str  # its resource's service.name
    status_code: int  # 0 unset, 1 ok, 2 error


@dataclass
class Receiver:
    url: str = ""
    spans: list[ReceivedSpan] = field(default_factory=list)
    exports: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def take(self, payload: bytes) -> None:
        request = ExportTraceServiceRequest.FromString(payload)
        decoded = [
            _span(span, _attributes(resource.resource.attributes).get("service.name", ""))
            for resource in request.resource_spans
            for scope in resource.scope_spans
            for span in scope.spans
        ]
        with self._lock:
            self.spans.extend(decoded)
            self.exports += 1

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        with self._lock:
            return [span for span in self.spans if span.trace_id == trace_id]

    def wait_for_spans(self, trace_id: str, names: set[str]) -> dict[str, ReceivedSpan]:
        """The spans of `trace_id` by name, once every one of `names` has arrived."""
        wait_for(lambda: names <= {s.name for s in self.trace(trace_id)}, f"spans {sorted(names)}")
        return {span.name: span for span in self.trace(trace_id)}


def _span(span: Any, service: str) -> ReceivedSpan:
    return ReceivedSpan(
        name=span.name,
        trace_id=span.trace_id.hex(),
        span_id=span.span_id.hex(),
        parent_id=span.parent_span_id.hex(),
        start_ns=span.start_time_unix_nano,
        end_ns=span.end_time_unix_nano,
        attributes=_attributes(span.attributes),
        service=service,
        status_code=span.status.code,
    )


def _attributes(pairs: Any) -> dict[str, Any]:
    return {pair.key: _value(pair.value) for pair in pairs}


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    return None if kind is None else getattr(value, kind)


@contextmanager
def otlp_receiver() -> Iterator[Receiver]:
    """OTLP over HTTP (binary protobuf) at `receiver.url` (…/v1/traces)."""
    receiver = Receiver()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            payload = self.rfile.read(int(self.headers.get("content-length", 0)))
            receiver.take(payload)
            answer = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("content-type", "application/x-protobuf")
            self.send_header("content-length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    receiver.url = f"http://127.0.0.1:{server.server_address[1]}/v1/traces"
    try:
        yield receiver
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@contextmanager
def otlp_grpc_receiver() -> Iterator[Receiver]:
    """OTLP over gRPC at `receiver.url` (grpc://127.0.0.1:PORT)."""
    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

    receiver = Receiver()

    class Service(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request: ExportTraceServiceRequest, context: Any) -> ExportTraceServiceResponse:  # noqa: N802
            receiver.take(request.SerializeToString())
            return ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), server)  # type: ignore[no-untyped-call]
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    receiver.url = f"grpc://127.0.0.1:{port}"
    try:
        yield receiver
    finally:
        server.stop(grace=None)
