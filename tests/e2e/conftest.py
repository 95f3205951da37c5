"""A real `diffbatch serve` process on a free port, for the end-to-end tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.launch import ROOT, ServerProcess, start_server, stop_server

Server = ServerProcess

__all__ = ["EXECUTORS", "ROOT", "Server", "gated_env", "start_server", "stop_server"]


def gated_env(gate: Path) -> dict[str, str]:
    """Environment of a server that serves a test pipeline (`--pipeline-class
    tests.pipelines.custom:...`): the checkout is importable, and HOLD prompts wait for
    `gate` to exist."""
    return {"DIFFBATCH_TEST_GATE": str(gate), "PYTHONPATH": str(ROOT)}


# Every test of the shared servers runs against the pipeline in a thread of the server and
# in a worker process (`--executor`): the two must not differ in anything a client sees.
EXECUTORS = ["thread", "process"]


@pytest.fixture(scope="package", params=EXECUTORS)
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The tiny-sd preset in request-level batching, with a long admission wait: requests
    sent together form one batch (tests count forwards)."""
    instance = start_server(
        tmp_path_factory.mktemp("e2e"),
        "--batching",
        "request",
        "--request-batch-max-wait-ms",
        "2000",
        "--executor",
        request.param,
    )
    yield instance
    stop_server(instance)
