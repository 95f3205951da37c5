"""The test suite's zygote (tests/server_zygote.py): which server starts it forks, and how a
forked server's end reads (the e2e tests run every start through it)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.server_zygote import ForkedServer, Zygote

DIFFBATCH = str(Path(sys.executable).parent / "diffbatch")


@pytest.mark.parametrize(
    ("command", "extra", "forks"),
    [
        ([DIFFBATCH, "serve", "--port", "1"], {}, True),
        # Read while the server runs: the same start either way.
        ([DIFFBATCH, "serve"], {"DIFFBATCH_TEST_GATE": "/tmp/gate", "PYTHONPATH": "/x"}, True),
        ([DIFFBATCH, "bench"], {}, False),
        ([DIFFBATCH, "serve", "--ray-address", "127.0.0.1:1"], {}, False),
        ([sys.executable, "serve"], {}, False),
        # Read by torch, OpenMP or huggingface_hub as they are imported: the zygote's are stale.
        ([DIFFBATCH, "serve"], {"OMP_NUM_THREADS": "7"}, False),
        ([DIFFBATCH, "serve"], {"HF_HUB_OFFLINE": "0"}, False),
        ([DIFFBATCH, "serve"], {"TORCH_LOGS": "+dynamo"}, False),
    ],
)
def test_which_starts_are_forked(command: list[str], extra: dict[str, str], forks: bool) -> None:
    zygote = Zygote()
    try:
        assert zygote._forkable(command, {**os.environ, **extra}) is forks
    finally:
        zygote.close()


def test_a_forked_servers_end_reads_as_popens(tmp_path: Path) -> None:
    """A status file the zygote writes as it reaps: the exit code, or minus the signal."""
    status = tmp_path / "status"
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        server = ForkedServer(child.pid, status)
        assert server.poll() is None and server.returncode is None
        with pytest.raises(subprocess.TimeoutExpired):
            server.wait(timeout=0.05)
        server.send_signal(signal.SIGTERM)
        assert child.wait(timeout=60) == -signal.SIGTERM
        status.write_text(str(child.returncode))  # as the zygote does when it reaps the pid
        assert server.wait(timeout=60) == -signal.SIGTERM and server.returncode == -signal.SIGTERM
        server.kill()  # over: nothing to signal, as Popen
    finally:
        child.kill()
        child.wait()
