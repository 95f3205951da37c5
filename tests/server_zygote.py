"""Servers for the tests without paying for their imports each time: a zygote process imports
torch, diffusers, transformers and the server's own packages once, and forks a `diffbatch
serve` for each server a test starts (`bench.launch.launcher`).

Each start of `diffbatch serve` spent ~4.5 of its ~6.5 CPU-seconds importing those packages,
and the suite starts about a hundred servers on 2 cores. A forked server is still a process
of its own, started from the real command line (`server.cli.main` with the test's arguments,
environment, working folder and log), stopped by signals, its exit status read as
`subprocess.Popen`'s; only the imports were done before the fork.

It falls back to `subprocess.Popen` where forking would not be the same start:
- a command other than `diffbatch serve`, or a server on Ray (`--ray-address`);
- an environment that changes a variable some already imported package reads at import time
  (torch's, OpenMP's, CUDA's, Hugging Face's: `_IMPORT_TIME_PREFIXES`);
- a zygote with more than one thread after its imports (a fork copies only the forking one).

Protocol: the test process writes one JSON request a line on the zygote's stdin; the zygote
forks, answers the server's pid on its stdout, and writes each server's exit status into a
file named after the pid in its status folder when it reaps it."""

from __future__ import annotations

import contextlib
import json
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import types
from pathlib import Path
from typing import Any

import numpy

from bench.launch import ServerHandle, popen

# Variables that packages imported before the fork read at import time: a server whose
# environment differs from the zygote's in one of them starts by exec instead.
_IMPORT_TIME_PREFIXES = (
    "TORCH",
    "PYTORCH",
    "OMP_",
    "MKL_",
    "KMP_",
    "CUDA",
    "HF_",
    "HUGGINGFACE",
    "TRANSFORMERS",
    "DIFFUSERS",
    "RAY_",
    "PYTHON",
)
_POLL_S = 0.02


def _import_time(name: str) -> bool:
    return name.startswith(_IMPORT_TIME_PREFIXES) and name != "PYTHONPATH"


class ForkedServer:
    """A server forked by the zygote, seen as `subprocess.Popen` sees its child."""

    def __init__(self, pid: int, status: Path) -> None:
        self._pid = pid
        self._status = status
        self._returncode: int | None = None

    @property
    def pid(self) -> int:
        return self._pid

    @property
    def returncode(self) -> int | None:
        return self._returncode

    def poll(self) -> int | None:
        if self._returncode is None and self._status.exists():
            self._returncode = int(self._status.read_text())
        return self._returncode

    def wait(self, timeout: float | None = None) -> int:
        give_up = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if give_up is not None and time.monotonic() > give_up:
                raise subprocess.TimeoutExpired(f"server {self._pid}", timeout or 0.0)
            time.sleep(_POLL_S)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # it ended and was reaped meanwhile
                os.kill(self._pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """The test process's end: starts the zygote on first use, one per pytest process."""

    def __init__(self) -> None:
        self._process: subprocess.Popen[bytes] | None = None
        self._status = Path(tempfile.mkdtemp(prefix="diffbatch-zygote-"))
        self._environment: dict[str, str] = {}
        self._lock = threading.Lock()
        self._usable = True

    def launch(self, command: list[str], log: Path, env: dict[str, str], own_group: bool) -> ServerHandle:
        if not self._forkable(command, env):
            return popen(command, log, env, own_group)
        with self._lock:
            process = self._started()
            request = {
                "argv": command,
                "env": env,
                "cwd": os.getcwd(),
                "log": str(log),
                "own_group": own_group,
            }
            assert process.stdin is not None and process.stdout is not None
            process.stdin.write(json.dumps(request).encode() + b"\n")
            process.stdin.flush()
            answer: dict[str, Any] = json.loads(process.stdout.readline() or b'{"pid": null}')
        if answer.get("pid") is None:  # it refused (threads) or died: exec from now on
            self._usable = False
            return popen(command, log, env, own_group)
        return ForkedServer(int(answer["pid"]), self._status / str(answer["pid"]))

    def _forkable(self, command: list[str], env: dict[str, str]) -> bool:
        serve = Path(command[0]).name == "diffbatch" and command[1:2] == ["serve"]
        if not self._usable or not serve or "--ray-address" in command:
            return False
        base = self._environment or dict(os.environ)
        names = set(env) | set(base)
        return not any(_import_time(name) and env.get(name) != base.get(name) for name in names)

    def _started(self) -> subprocess.Popen[bytes]:
        if self._process is None or self._process.poll() is not None:
            self.close()
            self._status.mkdir(exist_ok=True)
            self._environment = dict(os.environ)
            self._process = subprocess.Popen(
                [sys.executable, "-m", "tests.server_zygote", str(self._status)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env=self._environment,
            )
        return self._process

    def close(self) -> None:
        """End the zygote (its servers are the tests' to stop)."""
        if self._process is None:
            return
        with self._process:  # closes its pipes; the end of its stdin ends it
            assert self._process.stdin is not None
            self._process.stdin.close()
            try:
                self._process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._process.kill()
        self._process = None
        shutil.rmtree(self._status, ignore_errors=True)


# The zygote's side -------------------------------------------------------------------------


def _preload() -> None:
    """What a `diffbatch serve` of the tests imports before it loads a model."""
    import diffusers
    import torch  # noqa: F401
    import transformers

    import server.app
    import server.cli  # noqa: F401

    # diffusers and transformers import their classes on first use: touch the ones the tiny
    # models' loading meets (text encoders, their quantizer registry, the pipelines).
    for name in ("StableDiffusionPipeline", "FluxPipeline", "AutoencoderKL", "UNet2DConditionModel"):
        getattr(diffusers, name)
    for name in ("CLIPTextModel", "CLIPTokenizer", "T5EncoderModel", "PreTrainedModel"):
        getattr(transformers, name)


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _serve(status: Path) -> dict[str, Any] | None:
    """Answer requests until stdin closes; in a forked child, return its request."""
    _preload()
    stdin = sys.stdin.buffer
    children: set[int] = set()
    while True:
        ready, _, _ = select.select([stdin], [], [], _POLL_S * 5)
        _reap(children, status)
        if not ready:
            continue
        line = stdin.readline()
        if not line:
            return None
        request = json.loads(line)
        if _threads() != 1:  # a fork would copy only this thread: refuse, the caller execs
            _answer(None)
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            return dict(request)
        if request["own_group"]:
            with contextlib.suppress(OSError):  # the child does it too; whichever comes first
                os.setpgid(pid, pid)  # before anyone knows the pid, as Popen(process_group=0)
        children.add(pid)
        _answer(pid)


def _answer(pid: int | None) -> None:
    sys.stdout.write(json.dumps({"pid": pid}) + "\n")
    sys.stdout.flush()


def _reap(children: set[int], status: Path) -> None:
    for pid in list(children):
        done, code = os.waitpid(pid, os.WNOHANG)
        if done:
            children.discard(pid)
            returncode = -os.WTERMSIG(code) if os.WIFSIGNALED(code) else os.WEXITSTATUS(code)
            partial = status / f".{pid}"
            partial.write_text(str(returncode))
            partial.rename(status / str(pid))


def _become(request: dict[str, Any]) -> None:
    """In the forked child: the process `subprocess.Popen(request["argv"], ...)` would start."""
    if request["own_group"]:
        os.setpgid(0, 0)
    # Fresh random states, as a new interpreter draws them (the zygote's were drawn once).
    random.seed()
    numpy.random.seed()
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.close(null)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for entry in reversed(request["env"].get("PYTHONPATH", "").split(os.pathsep)):
        if entry and entry not in sys.path:
            sys.path.insert(0, entry)
    sys.argv = list(request["argv"])
    # No main module for multiprocessing's spawned children to import again: the console
    # script's `__main__` only calls `server.cli.main` under its `if __name__` guard.
    sys.modules["__main__"] = types.ModuleType("__main__")


if __name__ == "__main__":
    request = _serve(Path(sys.argv[1]))
    if request is not None:
        _become(request)
        from server.cli import main

        sys.exit(main(request["argv"][1:]))
