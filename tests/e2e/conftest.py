"""A real `diffbatch serve` process on a free port, for the end-to-end tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.launch import ROOT, ServerProcess, start_server, stop_server

Server = ServerProcess

__all__ = ["ROOT", "Server", "gated_env", "group_left", "start_server", "stop_server"]


def gated_env(gate: Path) -> dict[str, str]:
    """Environment of a server that serves a test pipeline (`--pipeline-class
    tests.pipelines.custom:...`): the checkout is importable, and HOLD prompts wait for
    `gate` to exist."""
    return {"DIFFBATCH_TEST_GATE": str(gate), "PYTHONPATH": str(ROOT)}


def group_left(group: int) -> list[str]:
    """The processes still running in process group `group` (zombies aside: they are over),
    as "pid command" (a server started with `own_group=True` leads the group of its pid)."""
    left = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            command = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # it ended meanwhile
        if int(fields[2]) == group and fields[0] != "Z":
            left.append(f"{stat.parent.name} {command[:120]}")
    return left


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The tiny-sd preset in request-level batching, with a long admission wait: requests
    sent together form one batch (tests count forwards). No deadline admission: its estimate
    comes from this machine's measured speed, and a busy machine must not turn a test's
    request into a 429 (tests/e2e/test_deadlines.py tests it on servers of its own).

    One per test session (per pytest-xdist worker): package-scoped, it was stopped whenever a
    worker went from the e2e modules to another package's, and started again at the next.

    Its pipeline runs where one worker's runs by default, in a thread of the server: what a
    worker process changes for a client (results through shared memory, previews, restarts)
    is tested where it is the subject (test_process_executor, test_step_batching, ...), not
    by running every client-facing test twice."""
    instance = start_server(
        tmp_path_factory.mktemp("e2e"),
        "--batching",
        "request",
        "--request-batch-max-wait-ms",
        "2000",
        "--deadline-admission",
        "off",
    )
    yield instance
    stop_server(instance)
