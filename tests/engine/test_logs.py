"""The JSON log lines (`engine.logs`): a record as one JSON object with the bound request's
fields, uvicorn's access fields and a traceback in one string; stray writes as records."""

from __future__ import annotations

import io
import json
import logging
import sys

from engine.logs import REQUEST, JsonFormatter, RequestContext, StrayLines


def record(
    name: str = "engine.core.engine", msg: str = "hello %s", args: tuple[object, ...] = ("you",)
) -> logging.LogRecord:
    return logging.LogRecord(name, logging.INFO, __file__, 1, msg, args, None)


def test_a_record_is_one_json_object_with_the_bound_requests_fields() -> None:
    token = REQUEST.set(RequestContext("req-1", "tiny-sd", "abc123"))
    try:
        entry = json.loads(JsonFormatter().format(record()))
    finally:
        REQUEST.reset(token)
    assert entry["message"] == "hello you" and entry["level"] == "info"
    assert entry["logger"] == "engine.core.engine" and entry["timestamp"].endswith("+00:00")
    assert (entry["request_id"], entry["model"], entry["tenant"]) == ("req-1", "tiny-sd", "abc123")


def test_extra_fields_and_a_traceback_stay_on_one_line() -> None:
    made = record()
    made.event, made.request_id = "finished", "req-2"
    try:
        raise ValueError("boom")
    except ValueError:
        made.exc_info = sys.exc_info()
    line = JsonFormatter().format(made)
    entry = json.loads(line)
    assert "\n" not in line and "ValueError: boom" in entry["exc_info"]
    assert (entry["event"], entry["request_id"]) == ("finished", "req-2") and "model" not in entry


def test_uvicorn_access_lines_carry_method_path_and_status() -> None:
    access = record("uvicorn.access", '%s - "%s %s HTTP/%s" %d', ("127.0.0.1:1", "POST", "/v1/x", "1.1", 200))
    entry = json.loads(JsonFormatter().format(access))
    assert (entry["method"], entry["path"], entry["status"]) == ("POST", "/v1/x", 200)


def test_stray_writes_become_records_line_by_line() -> None:
    logger = logging.getLogger("tests.stray")
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    logger.addHandler(keep := Keep())
    logger.propagate = False
    try:
        stream = StrayLines(logger, logging.WARNING, io.StringIO())
        stream.write("first line\nsecond ")
        stream.write("half\n\n")
        stream.write("10%\r50%\r100%\n")  # a progress bar: its last state
    finally:
        logger.removeHandler(keep)
    assert seen == ["first line", "second half", "100%"]
