"""A real `diffbatch serve` process on a free port, for the end-to-end tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from bench.launch import ROOT, ServerProcess, start_server, stop_server

Server = ServerProcess

__all__ = ["ROOT", "Server", "start_server", "stop_server"]


@pytest.fixture(scope="package")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The server the README describes: tiny-sd preset, request batching on."""
    instance = start_server(tmp_path_factory.mktemp("e2e"), "--request-batch-max-wait-ms", "2000")
    yield instance
    stop_server(instance)
