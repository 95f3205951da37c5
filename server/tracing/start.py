"""`start_tracing`: traces as the settings say — off (nothing of OpenTelemetry imported) or
on, with the SDK started (`server.tracing.otel`)."""

from __future__ import annotations

from server.settings.traces import TraceSettings
from server.tracing.tracing import TRACING_OFF, Tracing


def start_tracing(settings: TraceSettings) -> Tracing:
    if settings.otlp_traces_endpoint is None:
        return TRACING_OFF
    from server.tracing.otel import OtelTracing  # the SDK, only with the flag

    return OtelTracing.start(settings)
