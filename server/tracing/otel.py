"""`OtelTracing`: traces on (`--otlp-traces-endpoint`). One OpenTelemetry SDK `TracerProvider`
of the server's own (not the process-wide global, which another library may have set),
exporting in batches over OTLP (HTTP, or gRPC) from a thread of its own.

What is left to OpenTelemetry's standard variables: the sampler where
`--otlp-traces-sample-ratio` is not given (OTEL_TRACES_SAMPLER, OTEL_TRACES_SAMPLER_ARG;
the SDK's default samples every request, following a client's sampled flag), the batching of
exports (OTEL_BSP_SCHEDULE_DELAY, OTEL_BSP_MAX_QUEUE_SIZE, ...), the exporter's headers,
timeout and compression (OTEL_EXPORTER_OTLP_TRACES_HEADERS, ...), the service's name and
resource (OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES; the name is "diffbatch" otherwise)
and the propagators read from a client's headers (OTEL_PROPAGATORS).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager

from fastapi.telemetry import TelemetryConfig
from opentelemetry import trace
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, Sampler, TraceIdRatioBased
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from engine.core.stats import EngineObserver
from server.settings.traces import TraceSettings
from server.tracing.endpoint import TraceProtocol, exporter_endpoint
from server.tracing.engine_spans import EngineSpans
from server.tracing.tracing import Attribute, Tracing

logger = logging.getLogger(__name__)

INSTRUMENTATION = "diffbatch"
TRACED_PREFIX = "/v1/"
# The engine's request carries its parent as W3C Trace Context whatever OTEL_PROPAGATORS says.
W3C = TraceContextTextMapPropagator()


class OtelTracing(Tracing):
    def __init__(self, provider: TracerProvider) -> None:
        self.provider = provider
        self.tracer = provider.get_tracer(INSTRUMENTATION)

    @classmethod
    def start(cls, settings: TraceSettings) -> OtelTracing:
        """The SDK set up as `settings` say (their endpoint must be set)."""
        assert settings.otlp_traces_endpoint is not None
        protocol = settings.otlp_trace_protocol
        exporter = _exporter(settings.otlp_traces_endpoint, protocol)
        provider = TracerProvider(sampler=_sampler(settings.otlp_traces_sample_ratio), resource=_resource())
        provider.add_span_processor(BatchSpanProcessor(exporter))
        logger.info("tracing requests to %s (OTLP, %s)", settings.otlp_traces_endpoint, protocol)
        return cls(provider)

    def span(self, name: str, attributes: dict[str, Attribute] | None = None) -> AbstractContextManager[None]:
        return self._span(name, attributes)

    @contextmanager
    def _span(self, name: str, attributes: dict[str, Attribute] | None) -> Iterator[None]:
        with self.tracer.start_as_current_span(name, attributes=attributes):
            yield

    def traceparent(self) -> str | None:
        context = trace.get_current_span().get_span_context()
        if not context.is_valid or not context.trace_flags.sampled:
            return None  # the engine's spans would not be recorded either
        carrier: dict[str, str] = {}
        W3C.inject(carrier)
        return carrier.get("traceparent")

    def fastapi_telemetry(self) -> TelemetryConfig:
        """FastAPI's own server span per API request (paths under /v1/: health checks and
        scrapes would drown the rest), with this provider: it continues a client's
        `traceparent` (OTEL_PROPAGATORS), is named by the route, wraps every middleware (a
        refusal is traced too) and lasts until a stream's last event is sent. Its metrics and
        logs stay off (/metrics has the server's), and so do its spans of FastAPI's own
        steps (dependencies, serialization): the spans are the request's stages."""
        return {
            "tracer_provider": self.provider,
            "tracing": True,
            "metrics": False,
            "logs": False,
            "operation_spans": False,
            "auto_configure": False,  # its exporters from the environment would send ours twice
            "exclude": lambda scope: not str(scope.get("path", "")).startswith(TRACED_PREFIX),
        }

    def engine_observer(self, replica: str | None = None) -> EngineObserver:
        return EngineSpans(self.tracer, replica)

    def shutdown(self) -> None:
        self.provider.shutdown()  # sends what the batch holds, within the exporter's timeout


def _sampler(ratio: float | None) -> Sampler | None:
    """Parent-based on `ratio` where given; None leaves the choice to OTEL_TRACES_SAMPLER."""
    return None if ratio is None else ParentBased(TraceIdRatioBased(ratio))


def _resource() -> Resource:
    detected = Resource.create()  # OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES
    if str(detected.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        return detected.merge(Resource({SERVICE_NAME: INSTRUMENTATION}))
    return detected


def _exporter(endpoint: str, protocol: TraceProtocol) -> SpanExporter:
    url, insecure = exporter_endpoint(endpoint, protocol)
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        return GrpcExporter(endpoint=url, insecure=insecure)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

    return HttpExporter(endpoint=url)
