"""Traces: an OpenTelemetry trace of each API request (`--otlp-traces-endpoint`).

`tracing.py` is what the rest of the server calls (`Tracing`; off, it does nothing), and
`endpoint.py` reads the flag's URL: neither imports the OpenTelemetry SDK, so without the
flag it is never loaded (FastAPI itself imports the API, which does nothing alone). With it,
`otel.py` starts the SDK and its OTLP exporter and has FastAPI's own telemetry open a span
per API request (continuing a client's `traceparent`), and `engine_spans.py` turns each
request's engine timeline (`engine.timeline`) into spans when it ends — in this process,
or in the Ray Serve replica that ran it.
"""
