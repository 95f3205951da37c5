"""`Tracing`: what the routes and the start-up call to trace a request, whether traces are on
or not. This one is off: every call does nothing, and nothing of OpenTelemetry is imported.
`server.tracing.otel.OtelTracing` is the one that traces (`--otlp-traces-endpoint`)."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

from fastapi.telemetry import TelemetryConfig

from engine.core.stats import EngineObserver

Attribute = str | bool | int | float


class Tracing:
    """Traces off."""

    def span(self, name: str, attributes: dict[str, Attribute] | None = None) -> AbstractContextManager[None]:
        """A span named `name` around a stage of the current request (its HTTP request's span
        the parent), from entering to leaving the block; an exception leaving it marks it
        failed."""
        return nullcontext()

    def traceparent(self) -> str | None:
        """The W3C `traceparent` of the current span, for the engine's request
        (`GenerationRequest.traceparent`): its engine spans go under it, wherever it runs.
        None where nothing is traced (off, or not sampled)."""
        return None

    def fastapi_telemetry(self) -> TelemetryConfig:
        """FastAPI's own OpenTelemetry support, as the app is made with it: off, all of it,
        whatever providers the process has or its environment asks for (its
        FASTAPI_OTEL_AUTO_CONFIGURE): nothing is sent without the flag."""
        return {"tracing": False, "metrics": False, "logs": False, "auto_configure": False}

    def engine_observer(self, replica: str | None = None) -> EngineObserver | None:
        """The engine observer that turns each ended request's timeline into spans (None:
        off); `replica` names the Ray Serve replica whose engine it observes."""
        return None

    def shutdown(self) -> None:
        """Send what is left and stop (the server stops)."""


TRACING_OFF = Tracing()
