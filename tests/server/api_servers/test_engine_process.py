"""The engine process's word to its supervisor: a supervisor that died while the model
loaded is a line in the log, not a BrokenPipeError traceback (no process; milliseconds)."""

from __future__ import annotations

import logging
import multiprocessing

import pytest

from server.api_servers.engine_process import say_started


def test_started_said_to_a_supervisor_that_is_gone_is_a_log_line(caplog: pytest.LogCaptureFixture) -> None:
    supervisors, engines = multiprocessing.Pipe()  # duplex, as the supervisor makes it
    supervisors.close()  # it died while the engine was loading
    with caplog.at_level(logging.WARNING, logger="server.api_servers.engine_process"):
        assert say_started(engines) is False
    assert "the supervisor went away" in caplog.text
    engines.close()


def test_started_is_said_to_a_supervisor_that_listens() -> None:
    supervisors, engines = multiprocessing.Pipe()
    assert say_started(engines) is True
    assert supervisors.poll(5) and supervisors.recv() == "started"
    supervisors.close()
    engines.close()
