"""The trace settings (`ServeSettings` inherits this group): where OpenTelemetry traces of the
API requests go, over which OTLP protocol, and which share of them (`server.tracing`)."""

from __future__ import annotations

import importlib.util
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from server.settings.section import Section
from server.tracing.endpoint import SCHEMES, TraceProtocol, trace_protocol


class TraceSettings(Section):
    help_section = "traces (OpenTelemetry)"
    each_model = False

    otlp_traces_endpoint: str | None = Field(
        None,
        description="send an OpenTelemetry trace of each API request to this OTLP collector: "
        "http://HOST:4318/v1/traces (OTLP over HTTP; a URL without a path gets /v1/traces), or "
        "grpc://HOST:4317 for gRPC (grpcs:// with TLS); needs the [otel] extra (default: none, "
        "and then nothing is traced or sent, and OpenTelemetry is not even loaded)",
    )
    otlp_traces_protocol: TraceProtocol | None = Field(
        None,
        description="the OTLP protocol of --otlp-traces-endpoint (default: grpc for a grpc:// or "
        "grpcs:// URL, else OTEL_EXPORTER_OTLP_TRACES_PROTOCOL or OTEL_EXPORTER_OTLP_PROTOCOL "
        "where set, else http/protobuf); grpc needs the [otel-grpc] extra",
    )
    otlp_traces_sample_ratio: float | None = Field(
        None,
        ge=0,
        le=1,
        allow_inf_nan=False,
        description="the share of requests traced (0 to 1, by trace id), a client's traceparent "
        "deciding where it sends one (parent-based); default: OpenTelemetry's OTEL_TRACES_SAMPLER "
        "and OTEL_TRACES_SAMPLER_ARG, else every request",
    )

    @field_validator("otlp_traces_endpoint")
    @classmethod
    def _check_endpoint(cls, value: str | None) -> str | None:
        if value is None:
            return None
        parts = urlsplit(value.strip())
        if parts.scheme not in SCHEMES or not parts.hostname:
            raise ValueError(
                "must be a URL such as http://collector:4318/v1/traces or grpc://collector:4317, "
                f"got {value!r}"
            )
        return value.strip()

    @model_validator(mode="after")
    def _exporter_installed(self) -> TraceSettings:
        if self.otlp_traces_endpoint is None:
            return self
        needed = {"http/protobuf": ("otel", "http"), "grpc": ("otel-grpc", "grpc")}
        extra, module = needed[self.otlp_trace_protocol]
        if importlib.util.find_spec("opentelemetry.sdk") is None or not _has_exporter(module):
            raise ValueError(
                f"otlp_traces_endpoint over {self.otlp_trace_protocol} needs the [{extra}] extra "
                f"(pip install 'diffbatch[{extra}]')"
            )
        return self

    @property
    def otlp_trace_protocol(self) -> TraceProtocol:
        """The protocol traces are sent with (`otlp_traces_protocol`, resolved)."""
        return trace_protocol(self.otlp_traces_endpoint or "", self.otlp_traces_protocol)


def _has_exporter(protocol: str) -> bool:
    try:
        return importlib.util.find_spec(f"opentelemetry.exporter.otlp.proto.{protocol}") is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False
