"""One worker process of a `ProcessExecutor`, from its spawn to its end: started, waited for
while it loads (the log says what it loads, and how long it has taken so far), stopped
(`Stop`, or killed while it still loads: it reads nothing until it has loaded), reaped, and
what it leaves in shared memory swept.

Each worker (each restart too) sends its input images under a prefix of its own
(`engine.executor.shm.inputs_prefix`), so a sweep after it touches neither another lane's segments
nor those of the worker started after it.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing import resource_tracker
from typing import Any

from engine.executor.shm import Packer, discard, sweep, worker_prefix
from engine.executor.worker_loop import (
    Envelope,
    LoadFailed,
    Ready,
    RunBatch,
    RunStep,
    SettingRefusedError,
    Stop,
    WorkerOptions,
    opened,
    serve,
)

logger = logging.getLogger("engine.executor.process_executor")

# How often the log says that a worker is still loading.
LOADING_NOTE_EVERY_S = 30.0
_STOP_GRACE_S = 10.0
_REAP_S = 5.0


@dataclass(slots=True)
class WorkerStats:
    restarts: int = 0
    crashes: int = 0
    alive: bool = False
    # Why the worker is not serving, while it is not.
    down_reason: str | None = None
    segments_received: int = 0
    pid: int | None = None
    started_at: float = 0.0


@dataclass(frozen=True, slots=True)
class Unreadable:
    """A message from the worker that could not be read (logged, its segments unlinked)
    that ended run `call_id` (None: which run is unknown)."""

    call_id: int | None


class InputsNotSharedError(Exception):
    """A run's input images could not be put in shared memory (/dev/shm is full, say)."""


class WorkerProcess:
    """A spawned worker process, its end of the pipe, and the packer of its inputs."""

    def __init__(
        self,
        context: Any,
        load: Callable[[], Any],
        options: WorkerOptions,
        flags: list[Any],
        *,
        inputs: str,
        loading: str,
    ) -> None:
        self.conn, child = context.Pipe()
        self.process = context.Process(
            target=serve, args=(load, options, child, flags), name="diffbatch-worker", daemon=True
        )
        self.process.start()
        child.close()
        self.packer = Packer(inputs)  # the input images sent to this worker
        self.loading = loading
        self.ready = False

    @property
    def pid(self) -> int:
        pid: int = self.process.pid
        return pid

    def wait_ready(self, timeout_s: float) -> Ready:
        """Block until the worker has loaded (its `Ready`); raises if it cannot load, dies,
        or takes longer than `timeout_s` (it is killed then)."""
        logger.info("worker process %d: loading %s", self.pid, self.loading)
        started = time.monotonic()
        note_at = started + LOADING_NOTE_EVERY_S
        while (waited := time.monotonic() - started) < timeout_s:
            if time.monotonic() >= note_at:
                note_at += LOADING_NOTE_EVERY_S
                logger.info(
                    "worker process %d is still loading %s (%.0f s so far; it may take %g s, "
                    "--worker-start-timeout-s)",
                    self.pid,
                    self.loading,
                    waited,
                    timeout_s,
                )
            try:
                message = self._next_message()
            except (EOFError, OSError):
                break  # it died (or was stopped) while loading
            if isinstance(message, Ready):
                self.ready = True
                return message
            if isinstance(message, LoadFailed):
                self._end()
                if message.flag is not None:
                    raise SettingRefusedError(message.message, message.flag)
                raise RuntimeError(f"the worker could not load the pipeline: {message.message}")
            if not self.process.is_alive():
                break
        else:
            self._end()
            raise RuntimeError(
                f"the worker process did not load {self.loading} within {timeout_s:g} s: "
                "raise --worker-start-timeout-s if loading takes longer"
            )
        self._end()
        raise RuntimeError(f"the worker process did not start (exit code {self.process.exitcode})")

    def send(self, run: RunBatch | RunStep) -> None:
        """Send a run, its input images through shared memory (blocking: call it off the
        event loop). Raises `InputsNotSharedError`, or `OSError` if the worker is gone (the
        images are unlinked then: nobody will read them)."""
        try:
            packed = self.packer.pack(run)
        except OSError as exc:
            raise InputsNotSharedError(str(exc)) from exc
        try:
            self.conn.send(packed)
        except BaseException:
            discard(packed)
            raise

    def receive(self, stats: WorkerStats) -> Iterator[Any]:
        """Everything the worker sends, opened, until its end of the pipe closes (counting
        shared arrays in `stats`). A message that cannot be read is logged and its segments
        unlinked; if it ended a run (or which it is is unknown) an `Unreadable` comes instead."""
        while True:
            try:
                envelope = self.conn.recv()
            except (EOFError, OSError):
                return
            except Exception:  # the envelope itself
                logger.exception("could not read a message from worker process %d", self.pid)
                yield Unreadable(None)
                continue
            if not isinstance(envelope, Envelope):
                logger.error("worker process %d sent a %s", self.pid, type(envelope).__name__)
                yield Unreadable(None)
                continue
            stats.segments_received += len(envelope.segments)
            try:
                message = opened(envelope)
            except Exception:
                logger.exception("could not read a message from worker process %d", self.pid)
                if envelope.call_id is not None:  # else a progress report or a preview is lost
                    yield Unreadable(envelope.call_id)
                continue
            yield message

    def _next_message(self) -> Any:
        """What the worker sent within half a second, or None."""
        if not self.conn.poll(0.5):
            return None
        envelope = self.conn.recv()
        if not isinstance(envelope, Envelope):
            raise RuntimeError(f"the worker sent a {type(envelope).__name__}, not an Envelope")
        try:
            return opened(envelope)
        except Exception as exc:
            self._end()
            raise RuntimeError(f"could not read what the worker sent while loading: {exc}") from exc

    def _end(self) -> None:
        """Kill it, reap it, and close the parent's end of the pipe."""
        self.process.kill()
        self.process.join(timeout=_REAP_S)
        self.conn.close()

    def stop(self) -> None:
        """Stop it (a worker that serves gets `Stop` and some grace; one that is loading reads
        nothing, so it is killed at once), reap it, and sweep its segments. Another thread
        may be in `wait_ready`: its pipe is then left to that thread to close."""
        if self.ready:
            with contextlib.suppress(OSError, EOFError):
                self.conn.send(Stop())
            self.process.join(timeout=_STOP_GRACE_S)
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=_REAP_S)
        self.sweep()
        if self.ready:
            self.conn.close()

    def sweep(self) -> int:
        """Unlink what this worker created and nobody read, and the inputs it never read."""
        return sweep(worker_prefix(self.pid)) + sweep(self.packer.prefix)


def release_resource_tracker(timeout_s: float = _REAP_S) -> None:
    """Once no worker process is left, end the resource tracker that spawning them started
    and reap it, so that no process of the server outlives it: the server process ends on
    SIGTERM by re-raising the signal (uvicorn does, after its graceful shutdown), which
    runs no exit handler, and the tracker would outlive it for a while. It holds nothing:
    every segment is unregistered once sent or unlinked. A later spawn starts a new one."""
    if multiprocessing.active_children():  # (this also reaps children that ended)
        return
    tracker: Any = resource_tracker._resource_tracker
    with tracker._lock:
        fd, pid = tracker._fd, tracker._pid
        if fd is None or pid is None:
            return
        tracker._fd = tracker._pid = None
        os.close(fd)  # the tracker ends when every holder of this pipe has closed it
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ended, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return
        if ended:
            return
        time.sleep(0.01)
    logger.warning("the resource tracker process %d has not ended", pid)


def describe(model: str, device: str, pipeline_class: str | None) -> str:
    """What a worker loads, for the log."""
    through = f" through {pipeline_class}" if pipeline_class else ""
    return f"{model}{through} on {device}"


class SharedFlag:
    """A `Flag` both processes see: one byte of shared memory. No lock and no semaphore
    (so nothing for the resource tracker to report at exit): the engine only sets and
    clears it, the worker only reads it between steps, and a read that misses a set by
    a moment costs one more step at most."""

    def __init__(self, value: Any) -> None:
        self._value = value

    def set(self) -> None:
        self._value.value = True

    def clear(self) -> None:
        self._value.value = False

    def is_set(self) -> bool:
        return bool(self._value.value)

    def wait(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.is_set():
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(0.005)
        return True
