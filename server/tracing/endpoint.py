"""Where traces go and over which OTLP protocol, from `--otlp-traces-endpoint` and
`--otlp-traces-protocol` (and OpenTelemetry's own variables where those leave it open).
Pure: no OpenTelemetry import."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Literal
from urllib.parse import urlsplit, urlunsplit

TraceProtocol = Literal["http/protobuf", "grpc"]
SCHEMES = ("http", "https", "grpc", "grpcs")
# OTLP over HTTP's path for traces, where a URL names none (as OTEL_EXPORTER_OTLP_ENDPOINT).
TRACES_PATH = "/v1/traces"
_PROTOCOL_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")


def trace_protocol(
    endpoint: str, protocol: TraceProtocol | None, environ: Mapping[str, str] = os.environ
) -> TraceProtocol:
    """`protocol` where given; else gRPC for a grpc:// or grpcs:// URL; else OpenTelemetry's
    protocol variables where they name one of the two; else OTLP over HTTP."""
    if protocol is not None:
        return protocol
    if urlsplit(endpoint).scheme in ("grpc", "grpcs"):
        return "grpc"
    for name in _PROTOCOL_VARIABLES:
        value = environ.get(name, "").strip()
        if value in ("grpc", "http/protobuf"):
            return "grpc" if value == "grpc" else "http/protobuf"
    return "http/protobuf"


def exporter_endpoint(endpoint: str, protocol: TraceProtocol) -> tuple[str, bool]:
    """The URL the exporter is given, and whether its connection is plain (no TLS). gRPC's
    exporter reads http:// as plain and https:// as TLS: grpc:// and grpcs:// say the same.
    Over HTTP, a URL without a path gets OTLP's `/v1/traces`."""
    parts = urlsplit(endpoint)
    secure = parts.scheme in ("https", "grpcs")
    scheme = "https" if secure else "http"
    path = parts.path
    if protocol == "http/protobuf" and path in ("", "/"):
        path = TRACES_PATH
    return urlunsplit((scheme, parts.netloc, path, parts.query, "")), not secure
