"""How diffbatch's processes log: as text (the default, its lines as they always were) or as
one JSON object per line (`--log-format json`) that a log pipeline parses without rules.

A JSON line names the request it is about (its id, model, and tenant: the key's digest, as
its jobs are stored) from `REQUEST`, a contextvar the server binds when the request arrives,
which asyncio copies into every task and future callback made from there on; or from the
record's own `extra` (a worker knows the id only). A request's life is logged as events on
`EVENTS` (received, queued, finished). Whatever else reaches stderr or stdout in JSON mode
(a library's own handler, a warning, a print) becomes a JSON line too, so no line is left
for the pipeline to guess at. A leaf: the server, the engine and worker processes share it.
"""

from __future__ import annotations

import io
import json
import logging
import sys
import threading
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal, TextIO

LogFormat = Literal["text", "json"]
LOG_FORMATS: tuple[LogFormat, ...] = ("text", "json")

# The text format, unchanged since the first release.
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# The request-life events (received, queued, finished). In text logs they show only with
# --log-level debug, so the text format's lines stay what they were.
EVENTS = logging.getLogger("diffbatch.requests")


@dataclass(frozen=True, slots=True)
class RequestContext:
    """What every log line about one request says of it."""

    request_id: str
    model: str | None = None
    tenant: str | None = None


REQUEST: ContextVar[RequestContext | None] = ContextVar("diffbatch_request", default=None)

# `extra` fields a JSON line carries when a record has them (the request's own, and a
# request-life event's).
_FIELDS = ("request_id", "model", "tenant", "event", "outcome", "error", "seconds", "status")

# What `configure_logging` set in this process.
_configured: dict[str, LogFormat] = {"format": "text"}


def log_format() -> LogFormat:
    """The format `configure_logging` set in this process (a worker process is told it)."""
    return _configured["format"]


def log_event(event: str, message: str, *args: object, **fields: object) -> None:
    """Log one event of a request's life at info (`fields`: the request's id where no
    `REQUEST` is bound, and what the event says: an outcome, seconds)."""
    EVENTS.info(message, *args, extra={"event": event, **fields})


class JsonFormatter(logging.Formatter):
    """One JSON object per record: timestamp (UTC, ISO 8601), level, logger, message, pid,
    the request's fields where known, the traceback as one string."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "timestamp": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
            "pid": record.process,
        }
        context = REQUEST.get()
        if context is not None:
            bound = {"request_id": context.request_id, "model": context.model, "tenant": context.tenant}
            entry.update({k: v for k, v in bound.items() if v is not None})
        for name in _FIELDS:
            value = getattr(record, name, None)
            if value is not None:
                entry[name] = value
        entry.update(_access_fields(record))
        if record.exc_info:
            entry["exc_info"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack_info"] = self.formatStack(record.stack_info)
        return json.dumps(entry, default=str)


def _access_fields(record: logging.LogRecord) -> dict[str, Any]:
    """uvicorn's access lines as fields: its records' args are (client, method, path,
    HTTP version, status)."""
    args = record.args
    if record.name != "uvicorn.access" or not isinstance(args, tuple) or len(args) != 5:
        return {}
    return {"method": args[1], "path": args[2], "status": args[4]}


# Libraries whose INFO lines say nothing an operator acts on: they log at WARNING unless the
# server runs at DEBUG, so a start-time error stays the one line it is.
CHATTY = ("botocore", "boto3", "s3transfer", "urllib3")


def configure_logging(fmt: LogFormat, level: int | str) -> None:
    """This process's logging: the root logger at `level` in `fmt`. In JSON, uvicorn's
    loggers are left to propagate here (the server starts uvicorn without its own log
    config), warnings are logged, and stray writes to stderr and stdout become records."""
    _configured["format"] = fmt
    if isinstance(level, str):
        level = logging.getLevelNamesMapping()[level.upper()]
    for name in CHATTY:  # their INFO lines ("Found credentials in environment variables")
        logging.getLogger(name).setLevel(logging.NOTSET if level <= logging.DEBUG else logging.WARNING)
    if fmt == "text":
        logging.basicConfig(level=level, format=TEXT_FORMAT)
        EVENTS.setLevel(logging.DEBUG if level <= logging.DEBUG else logging.WARNING)
        return
    stream = sys.__stderr__ or sys.stderr
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    logging.basicConfig(level=level, handlers=[handler], force=True)
    EVENTS.setLevel(logging.NOTSET)
    logging.captureWarnings(True)
    if not isinstance(sys.stderr, StrayLines):
        sys.stderr = StrayLines(logging.getLogger("stderr"), logging.WARNING, stream)
        sys.stdout = StrayLines(logging.getLogger("stdout"), logging.INFO, sys.__stdout__ or sys.stdout)


class StrayLines(io.TextIOBase):
    """A text stream that logs each line written to it: in JSON mode, what a library prints
    (or its own log handler, made with `sys.stderr`, writes) leaves as a JSON line. A write
    made while this thread is logging (logging's own error report) goes to `raw`."""

    def __init__(self, logger: logging.Logger, level: int, raw: TextIO) -> None:
        super().__init__()
        self._logger = logger
        self._level = level
        self._raw = raw
        self._pending = ""
        self._lock = threading.Lock()
        self._inside = threading.local()

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        if getattr(self._inside, "logging", False):
            return self._raw.write(text)
        with self._lock:
            lines = (self._pending + text).split("\n")
            self._pending = lines.pop()
        for line in lines:
            self._log(line)
        return len(text)

    def flush(self) -> None:
        self._raw.flush()

    def fileno(self) -> int:
        return self._raw.fileno()

    def isatty(self) -> bool:
        return False

    def _log(self, line: str) -> None:
        # A progress bar redraws its line after each carriage return: its last state counts.
        drawn = [part for part in line.split("\r") if part.strip()]
        if not drawn:
            return
        line = drawn[-1]
        self._inside.logging = True
        try:
            self._logger.log(self._level, "%s", line)
        finally:
            self._inside.logging = False
