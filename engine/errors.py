"""Why a request did not get its images. The server maps each to an HTTP status.

EngineError
├── QueueFullError           the admission queue is full; retry later (429)
├── DeadlineUnmeetableError  the work ahead would make it finish past its deadline (429)
├── DuplicateRequestError    a request with this id is already in the engine (409)
├── RequestAbortedError      aborted by the caller or by shutdown
├── DeadlineExceededError    the request's deadline passed before it finished (504)
├── EngineNotRunningError    the engine is not started, or is stopping (503)
├── WorkerCrashedError       the worker process running it died; it is being restarted (503)
│   └── EngineRestartingError  the engine process (--api-server-count) died or is restarting (503)
├── ModelUnavailableError    its model failed to load, or was not loaded in time (503)
├── ContentPolicyError       the safety checker flagged an image it made (400)
└── ForwardError             the pipeline failed for this request (500)
    └── WorkerMessageError   the worker's answer for it could not be read (500)
InvalidRequestError          the request cannot be served as given (400); a ValueError
└── UnsupportedFieldError    it sets a field this model has no use for (400)
"""

from __future__ import annotations

from engine.request import InvalidRequestError, UnsupportedFieldError


class EngineError(Exception):
    """Base of every engine-side failure of a request."""


class QueueFullError(EngineError):
    def __init__(self, max_queue_len: int, retry_after_s: float, message: str | None = None) -> None:
        super().__init__(
            message
            or f"the server already has {max_queue_len} requests waiting; retry after {retry_after_s:.0f} s"
        )
        self.retry_after_s = retry_after_s
        self._max_queue_len = max_queue_len

    def __reduce__(self) -> tuple[object, ...]:  # pickled whole (a Ray Serve replica's answer)
        return (type(self), (self._max_queue_len, self.retry_after_s, str(self)))


class DeadlineUnmeetableError(EngineError):
    """Refused at admission: it would finish past its deadline (`engine.sched.deadline_admission`).
    `retry` False when even alone it could not finish in time."""

    def __init__(self, message: str, retry_after_s: float, retry: bool = True) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.retry = retry

    def __reduce__(self) -> tuple[object, ...]:  # pickled whole (a Ray Serve replica's answer)
        return (type(self), (str(self), self.retry_after_s, self.retry))


class DuplicateRequestError(EngineError):
    def __init__(self, request_id: str) -> None:
        super().__init__(f"request_id {request_id!r} is already in the engine")
        self.request_id = request_id

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.request_id,))


class RequestAbortedError(EngineError):
    pass


class DeadlineExceededError(EngineError):
    pass


class EngineNotRunningError(EngineError):
    pass


class ModelUnavailableError(EngineError):
    """One of several served models cannot serve: its load failed (`retry` False: sending the
    request again will not help until the model is fixed), or no room was made for it in time."""

    def __init__(self, message: str, retry: bool = True) -> None:
        super().__init__(message)
        self.retry = retry

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (str(self), self.retry))


class WorkerCrashedError(EngineError):
    """The worker process running the request died (or is restarting); retrying is safe."""


class EngineRestartingError(WorkerCrashedError):
    """With several API processes, the engine process they reach over IPC went away (it
    died, or is starting again): its requests ended, and sending them again is safe."""


class ContentPolicyError(EngineError):
    """The safety checker (`--safety-checker`) flagged an image the request made: that
    request fails, its batch peers get their images (`engine.worker.moderation`)."""

    def __init__(self, level: str) -> None:
        super().__init__(
            "your request was rejected by this server's safety system: an image it generated "
            f"was flagged (moderation: {level}); revise the prompt and try again"
        )
        self.level = level

    def __reduce__(self) -> tuple[object, ...]:  # pickled whole (a worker process's answer)
        return (type(self), (self.level,))


class ForwardError(EngineError):
    """The pipeline raised while running this request (alone, after isolation)."""


class WorkerMessageError(ForwardError):
    """The worker process answered the run of this request with a message the server could
    not read (unpickle, or copy out of shared memory); the worker itself serves on."""


__all__ = [
    "ContentPolicyError",
    "DeadlineExceededError",
    "DeadlineUnmeetableError",
    "DuplicateRequestError",
    "EngineError",
    "EngineNotRunningError",
    "EngineRestartingError",
    "ForwardError",
    "InvalidRequestError",
    "QueueFullError",
    "RequestAbortedError",
    "UnsupportedFieldError",
    "WorkerCrashedError",
    "WorkerMessageError",
]


def as_engine_error(error: Exception) -> Exception:
    """What a request's caller gets for a pipeline failure: bad input as it is, anything else
    as a `ForwardError` naming the failure, without a traceback (that stays in the log)."""
    if isinstance(error, InvalidRequestError | ForwardError | WorkerCrashedError | ContentPolicyError):
        return error
    return ForwardError(f"the pipeline failed for this request: {type(error).__name__}: {error}")
