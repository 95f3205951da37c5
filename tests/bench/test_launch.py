"""`bench.launch`'s start hang guard: a server of several API processes starts one process
per API process and the engine's, each importing torch on the same cores, and is given the
one-process guard once for each (the e2e suite through `DIFFBATCH_TEST_API_SERVERS=2`)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.launch import ServerProcess, free_port, starting_processes, wait_until_ready


@pytest.mark.parametrize(
    ("flags", "processes"),
    [([], 1), (["--api-server-count", "1"], 1), (["--api-server-count", "2"], 3)],
)
def test_a_server_of_n_api_processes_starts_n_plus_one(flags: list[str], processes: int) -> None:
    assert starting_processes(["diffbatch", "serve", "--port", "8000", *flags]) == processes


def test_the_start_guard_is_given_once_per_starting_process(tmp_path: Path) -> None:
    """A process that never answers /health, of a server said to start 3: given up on after
    3 guards, not 1 (a lower bound only, whatever the machine's speed)."""
    log = tmp_path / "server.log"
    log.write_text("still importing torch")
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    server = ServerProcess(f"http://127.0.0.1:{free_port()}", sleeper, log, starting_processes=3)
    began = time.monotonic()
    with pytest.raises(RuntimeError, match=r"not ready in 1\.5 s"):
        wait_until_ready(server, timeout_s=0.5)
    assert time.monotonic() - began >= 1.5
    assert sleeper.poll() is not None  # stopped once given up on
