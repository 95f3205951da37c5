"""Start and stop a real `diffbatch serve` process on a free port (benchmarks and e2e tests)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import httpx

ROOT = Path(__file__).resolve().parents[1]
# `DIFFBATCH_TEST_API_SERVERS=2 pytest tests/e2e`: every server started here runs that many
# API processes in front of its engine process (`--api-server-count`), unless it sets its
# own count or runs on Ray (docs/development.md).
API_SERVERS_VARIABLE = "DIFFBATCH_TEST_API_SERVERS"


class ServerHandle(Protocol):
    """What the tests and benchmarks use of a server's process: `subprocess.Popen`'s."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, sig: int) -> None: ...

    def kill(self) -> None: ...


# How a server's process starts: its command, log file, whole environment and whether it
# leads a process group of its own. `subprocess.Popen` here; the test suite starts most of
# its servers by forking a process that has already imported what a server imports
# (tests/server_zygote.py), which is what the hook is for.
Launcher = Callable[[list[str], Path, dict[str, str], bool], ServerHandle]


def popen(command: list[str], log: Path, env: dict[str, str], own_group: bool) -> ServerHandle:
    with log.open("wb") as sink:
        return subprocess.Popen(
            command, stdout=sink, stderr=subprocess.STDOUT, env=env, process_group=0 if own_group else None
        )


launcher: Launcher = popen


@dataclass
class ServerProcess:
    url: str
    process: ServerHandle
    log: Path
    # The processes that import torch and diffusers as the server starts: 1, or with
    # `--api-server-count N` N API processes and the engine process, on the same cores.
    starting_processes: int = 1

    @property
    def v1(self) -> str:
        return f"{self.url}/v1"

    def metric(self, line_prefix: str) -> float:
        """The value of the first /metrics sample whose line starts with `line_prefix`."""
        for line in httpx.get(f"{self.url}/metrics").text.splitlines():
            if line.startswith(line_prefix):
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError(f"no metric line starts with {line_prefix!r}")

    def labelled_count(self, line_prefix: str) -> float:
        """A labelled counter's sample, 0 while no sample has that label set yet — but only
        if the server exports the metric at all: a renamed metric fails, never reads as 0."""
        family = line_prefix.split("{", 1)[0]
        text = httpx.get(f"{self.url}/metrics").text
        if f"# TYPE {family} counter" not in text:
            raise AssertionError(f"the server exports no counter {family!r}")
        for line in text.splitlines():
            if line.startswith(line_prefix):
                return float(line.rsplit(" ", 1)[1])
        return 0.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def start_server(
    workdir: Path,
    *args: str,
    config: str | None = "tiny-sd.yaml",
    env: dict[str, str] | None = None,
    ready_timeout_s: float = 120,
    own_group: bool = False,
) -> ServerProcess:
    """`diffbatch serve --config configs/CONFIG ARGS`, logging to a file in `workdir`
    (`own_group`: in a process group of its own, whose id is the server's pid)."""
    server = spawn_server(workdir, *args, config=config, env=env, own_group=own_group)
    wait_until_ready(server, ready_timeout_s)
    return server


def spawn_server(
    workdir: Path,
    *args: str,
    config: str | None = "tiny-sd.yaml",
    env: dict[str, str] | None = None,
    own_group: bool = False,
) -> ServerProcess:
    """Start the process without waiting, so several servers can load their models at once."""
    port = free_port()
    log = workdir / f"server-{port}.log"
    preset = ["--config", str(ROOT / "configs" / config)] if config else []
    command = [
        str(Path(sys.executable).parent / "diffbatch"),
        "serve",
        *preset,
        "--port",
        str(port),
        "--output-dir",
        str(workdir / "outputs"),
        *args,
        *_api_servers(args),
    ]
    process = launcher(command, log, {**os.environ, **(env or {})}, own_group)
    return ServerProcess(f"http://127.0.0.1:{port}", process, log, starting_processes(command))


def _api_servers(args: tuple[str, ...]) -> list[str]:
    count = os.environ.get(API_SERVERS_VARIABLE, "").strip()
    if not count or "--api-server-count" in args or "--ray-address" in args:
        return []
    return ["--api-server-count", count]


def starting_processes(command: list[str]) -> int:
    """The processes the server of `command` starts, each importing torch and diffusers."""
    if "--api-server-count" not in command:
        return 1
    count = int(command[command.index("--api-server-count") + 1])
    return 1 if count <= 1 else count + 1  # one process holds the engine itself: no others


def wait_until_ready(server: ServerProcess, timeout_s: float = 120) -> None:
    """Poll /health until 200; a process that exits or stays unready raises with its log.

    `timeout_s` is a hang guard for a server of one process: one of several API processes
    gets it once per process it starts (`starting_processes`), each importing torch and
    diffusers on the same cores. On the loaded 2-core machine (a load of 15-21) the e2e
    suite with `DIFFBATCH_TEST_API_SERVERS=2` failed 25 tests at their one-process start
    timeouts, servers of 2 API processes whose engine became ready 13 s to 3.3 min late."""
    timeout_s *= server.starting_processes
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"server exited with {server.process.returncode}:\n{server.log.read_text()}")
        try:
            # A poll's own guard is no tighter than the start's: on a busy machine a Ray Serve
            # gateway's answer took over a second for two minutes after its application ran.
            if httpx.get(f"{server.url}/health", timeout=10).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    stop_server(server)
    raise RuntimeError(f"server not ready in {timeout_s} s:\n{server.log.read_text()}")


def kill_server(server: ServerProcess) -> None:
    """Kill every process of the server at once with SIGKILL, none left to say anything: a
    crash of the whole server as a container's end, systemd's final kill of its cgroup or
    the host going down do it (a server started with `own_group=True`). The server alone
    killed (`stop_server(server, signal.SIGKILL)`) is another event with several processes:
    its children see it gone and stop as on SIGTERM (docs/scaling.md)."""
    os.killpg(server.process.pid, signal.SIGKILL)
    server.process.wait()


def stop_server(server: ServerProcess, sig: signal.Signals = signal.SIGTERM) -> None:
    """Stop gracefully (SIGTERM), or the server process alone like a crash with
    `sig=signal.SIGKILL` (the whole server at once: `kill_server`)."""
    server.process.send_signal(sig)
    try:
        # A hang guard, not a speed check: a server on Ray Serve deletes its application and
        # shuts Serve down as it stops, which took over 20 s on a busy 2-core machine.
        server.process.wait(timeout=120)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait()
