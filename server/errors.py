"""The one place that maps failures to HTTP statuses and OpenAI error objects.

Every error leaves as `{"error": {"message", "type", "param", "code"}}`; validation
errors are 400 (never FastAPI's bare 422 body) and no stack trace is ever sent.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.errors import (
    ContentPolicyError,
    DeadlineExceededError,
    DeadlineUnmeetableError,
    DuplicateRequestError,
    EngineNotRunningError,
    EngineRestartingError,
    ForwardError,
    InvalidRequestError,
    ModelUnavailableError,
    QueueFullError,
    RequestAbortedError,
    UnsupportedFieldError,
    WorkerCrashedError,
)
from engine.request import LoraRef
from server.jobs.model import JobStoreUnavailableError
from server.outputs.store import OutputStoreUnavailableError
from server.protocol import ErrorBody, ErrorResponse

logger = logging.getLogger(__name__)


class APIError(Exception):
    """An error to send as an OpenAI error object with `status`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        retry: bool | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers
        # Whether the same request may succeed if sent again: only when the server is busy
        # or not ready (429, 503). Said in `x-should-retry`, which the official client obeys
        # instead of retrying every 5xx twice (running a doomed request three times).
        self.retry = status in (429, 503) if retry is None else retry

    def __reduce__(self) -> tuple[object, ...]:  # pickled whole (a key's 429 from the engine process)
        return (_rebuilt_api_error, (type(self), dict(vars(self))))


def _rebuilt_api_error(cls: type[APIError], state: dict[str, object]) -> APIError:
    """An `APIError` (or subclass, whatever its constructor takes) as it was pickled."""
    error = cls.__new__(cls)
    Exception.__init__(error, state["message"])
    error.__dict__.update(state)
    return error


class ClientDisconnectedError(Exception):
    """The client closed the connection before its result was ready."""


# As nginx logs a request whose client closed the connection first.
CLIENT_CLOSED_REQUEST = 499


# What an error may answer, for the OpenAPI description of every route (FastAPI's own 422 is
# never sent: validation errors are 400).
_STATUS_TEXT = {
    400: "invalid request (the field is in param), or an image the safety checker flagged "
    "(content_policy_violation)",
    401: "missing or invalid API key",
    403: "a cross-origin request to a server without an API key",
    404: "no such model, video or file",
    409: "a request with this id is already in progress",
    413: "the body or an upload is too large",
    415: "the body is not of a content type this route takes",
    429: "the queue is full, or the work ahead would make the request miss its deadline; retry "
    "after Retry-After seconds",
    500: "the pipeline failed for this request",
    503: "the model is loading, the server is shutting down, or its job or output store is unavailable",
    504: "the request did not finish before its deadline",
}
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": text} for status, text in _STATUS_TEXT.items()
}
# Image routes answer JSON, or server-sent events with `stream: true`.
IMAGE_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "the images as JSON, or with stream: true as server-sent events",
        "content": {"application/json": {}, "text/event-stream": {}},
    }
}


# The code of a 400 for a field the model has no use for (`UnsupportedFieldError`).
UNSUPPORTED_FIELD = "unsupported_field"
# Engine parameters that the wire names differently.
_WIRE_PARAM = {"width": "size", "height": "size", "input_images": "image"}


# Engine failure -> (HTTP status, OpenAI error type, code). Checked in order.
_ENGINE_ERRORS: list[tuple[type[Exception], int, str, str | None]] = [
    (QueueFullError, 429, "rate_limit_error", "queue_full"),
    (DeadlineUnmeetableError, 429, "rate_limit_error", "deadline_unmeetable"),
    (DuplicateRequestError, 409, "invalid_request_error", "duplicate_request_id"),
    (DeadlineExceededError, 504, "server_error", "timeout"),
    (EngineNotRunningError, 503, "server_error", "engine_not_ready"),
    (EngineRestartingError, 503, "server_error", "engine_restarting"),
    (WorkerCrashedError, 503, "server_error", "worker_restarting"),
    (ModelUnavailableError, 503, "server_error", "model_unavailable"),
    (RequestAbortedError, 499, "server_error", "aborted"),
    # As OpenAI answers an image its safety system rejected.
    (ContentPolicyError, 400, "invalid_request_error", "content_policy_violation"),
    (ForwardError, 500, "server_error", "generation_failed"),
]


def from_engine_error(exc: Exception, lora: LoraRef | None = None, lora_param: str = "lora") -> APIError:
    """Translate an engine failure into the API error the client sees. `lora` is the adapter
    the request ran with and `lora_param` the field that chose it (`lora`, `model`, or a
    remix's `video_id`), for an adapter the pipeline could not load."""
    if isinstance(exc, InvalidRequestError) and exc.param == "model":
        return _adapter_error(exc, lora, lora_param)
    if isinstance(exc, InvalidRequestError):
        code = UNSUPPORTED_FIELD if isinstance(exc, UnsupportedFieldError) else None
        return APIError(400, str(exc), param=_WIRE_PARAM.get(exc.param or "", exc.param), code=code)
    if isinstance(exc, OutputStoreUnavailableError):  # its reason is logged once, by the store
        return APIError(503, str(exc), type="server_error", code="output_store_unavailable")
    for kind, status, error_type, code in _ENGINE_ERRORS:
        if isinstance(exc, kind):
            headers = None
            if isinstance(exc, QueueFullError | DeadlineUnmeetableError):
                headers = {"Retry-After": str(max(1, round(exc.retry_after_s)))}
            retry = exc.retry if isinstance(exc, ModelUnavailableError | DeadlineUnmeetableError) else None
            return APIError(status, str(exc), type=error_type, code=code, headers=headers, retry=retry)
    logger.error("unexpected error", exc_info=exc)
    return APIError(500, "internal server error", type="server_error")


def _adapter_error(exc: InvalidRequestError, lora: LoraRef | None, param: str) -> APIError:
    """Pipelines refuse the adapter a request chose with `param="model"` and a message for the
    operator (the adapter's source path and the loader's exception): that goes to the log,
    the client learns which adapter and the field it sent (the server had already checked
    that the name is one it serves)."""
    logger.warning("a request's LoRA adapter cannot be used: %s", exc)
    name = f" {lora.name!r}" if lora is not None else ""
    return APIError(
        400,
        f"the LoRA adapter{name} cannot be loaded into the model this server serves; its operator "
        "can read why in the server log",
        param=param if lora is not None else "model",
        code="lora_unavailable",
    )


# Seconds a client should wait before retrying a 503 (the model loading, the server
# draining) when the error names none.
RETRY_AFTER_S = 5


def error_response(error: APIError) -> JSONResponse:
    body = ErrorResponse(
        error=ErrorBody(message=error.message, type=error.type, param=error.param, code=error.code)
    )
    headers = {"x-should-retry": "true" if error.retry else "false", **(error.headers or {})}
    if error.retry:
        headers.setdefault("Retry-After", str(RETRY_AFTER_S))
    return JSONResponse(body.model_dump(), status_code=error.status, headers=headers)


# What a field of each type must be, for the type errors of strict validation: a JSON
# body's string or boolean where a number is wanted (`server.protocol`).
_WANTED = {
    "int_type": "an integer",
    "float_type": "a number",
    "bool_type": "true or false",
    "string_type": "a string",
    "model_type": "a JSON object",
    "model_attributes_type": "a JSON object",
    "dict_type": "a JSON object",
}


def _validation_message(exc: RequestValidationError) -> APIError:
    first = exc.errors()[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(loc) or None
    kind = first.get("type")
    if kind == "extra_forbidden":
        message = f"unknown parameter {param!r}"
    elif kind == "json_invalid" or (kind in _WANTED and param is None):
        message = "the request body must be a JSON object"
        param = None
    elif kind in _WANTED:
        # Named by kind, never echoed: the value may be anything the caller sent.
        message = f"{param}: must be {_WANTED[kind]}, not {_json_kind(first.get('input'))}"
    else:
        message = first.get("msg", "invalid request")
        message = message.removeprefix("Value error, ")
        if param:
            message = f"{param}: {message}"
    return APIError(400, message, param=param)


def _json_kind(value: Any) -> str:
    """What a JSON value is, in words (`True` is checked before numbers: it is an int)."""
    if value is None:
        return "null"
    for kinds, name in (
        (bool, "a boolean"),
        (str, "a string"),
        ((int, float), "a number"),
        (list, "an array"),
        (dict, "an object"),
    ):
        if isinstance(value, kinds):
            return name
    return type(value).__name__


def describe_errors_in_openapi(app: FastAPI) -> None:
    """The OpenAPI description without FastAPI's 422 (this server answers 400 instead)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for operations in schema.get("paths", {}).values():
                for operation in operations.values():
                    operation.get("responses", {}).pop("422", None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(_validation_message(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        # Its headers too: a 405 must say which methods are allowed (Allow).
        return error_response(
            APIError(exc.status_code, str(exc.detail), code=code, headers=dict(exc.headers or {}))
        )

    @app.exception_handler(ClientDisconnectedError)
    async def _client_gone(request: Request, _: ClientDisconnectedError) -> Response:
        # Not a server error: no traceback, no 5xx in the metrics (the engine has logged the
        # abort of the request, with its id). Nobody reads this response.
        logger.info("client went away before %s %s was answered", request.method, request.url.path)
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    @app.exception_handler(JobStoreUnavailableError)
    async def _store_unavailable(_: Request, exc: JobStoreUnavailableError) -> JSONResponse:
        # The database, not this request: said once an outage in the log (`StoreHealth`),
        # retried by clients.
        logger.info("%s", exc)
        return error_response(
            APIError(503, str(exc), type="server_error", code="job_store_unavailable", retry=True)
        )

    @app.exception_handler(OutputStoreUnavailableError)
    async def _outputs_unavailable(_: Request, exc: OutputStoreUnavailableError) -> JSONResponse:
        return error_response(from_engine_error(exc))  # its reason is logged once, by the store

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        return error_response(from_engine_error(exc))
