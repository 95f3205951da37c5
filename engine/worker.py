"""The worker process of `ProcessExecutor`: one pipeline, driven by small typed messages.

The parent sends `RunBatch` / `RunStep` / `Stop` through a pipe; the worker answers each
run with `Done` (a `BatchOutput`) or `Failed` (the executor itself broke), and sends
`Progress` and `Partial` (a preview) as they happen. Every large array in a message, either
way, travels through shared memory (`engine.shm`). The engine's two flags (the forward's
`interrupt`, step mode's `attention`) are multiprocessing events shared with the parent,
named in each run by their index.

This module runs in the child; only `serve` touches the pipeline (and so torch).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from engine.decoding import DecodeOverlap
from engine.forward import BatchOutput, run_batch
from engine.request import PartialImage, RequestBatch
from engine.shm import Packer, unpack, worker_prefix
from engine.step_scheduler import StepPlan
from engine.stepping import StepRunner

logger = logging.getLogger(__name__)


# Parent -> worker ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RunBatch:
    call_id: int
    batch: RequestBatch
    interrupt: int  # index of the flag that stops the forward at its next step


@dataclass(frozen=True, slots=True)
class RunStep:
    call_id: int
    plan: StepPlan
    attention: int  # index of the flag that ends an iteration early


@dataclass(frozen=True, slots=True)
class Stop:
    pass


# Worker -> parent ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Ready:
    spec: Any  # the pipeline's `spec()`: its pure calls, without weights
    pid: int


@dataclass(frozen=True, slots=True)
class LoadFailed:
    message: str


@dataclass(frozen=True, slots=True)
class Progress:
    request_ids: list[str]
    done: int
    total: int


@dataclass(frozen=True, slots=True)
class Partial:
    partial: PartialImage


@dataclass(frozen=True, slots=True)
class Done:
    call_id: int
    output: BatchOutput


@dataclass(frozen=True, slots=True)
class Failed:
    call_id: int
    error: Exception


@dataclass(frozen=True, slots=True)
class WorkerOptions:
    """What the worker needs besides its pipeline config (picklable, for spawn)."""

    decode_overlap: DecodeOverlap = "off"
    log_level: int = logging.INFO


def serve(load: Any, options: WorkerOptions, conn: Connection, flags: list[Any]) -> None:
    """The worker's main: load the pipeline with `load()`, then run what the parent sends
    until `Stop` or until the parent's end of the pipe closes."""
    logging.basicConfig(level=options.log_level, format="%(asctime)s %(levelname)s worker: %(message)s")
    # The parent stops workers with Stop, or kills them; Ctrl-C in a terminal reaches the
    # whole process group, and the parent decides what happens then.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    packer = Packer(worker_prefix())
    sending = threading.Lock()  # progress and previews may come from other threads

    def send(message: Any) -> None:
        packed = packer.pack(message)
        with sending:
            conn.send(packed)

    try:
        pipeline = load()
    except Exception as exc:
        logger.exception("loading the pipeline failed")
        conn.send(LoadFailed(f"{type(exc).__name__}: {exc}"))
        return
    pipeline.progress_callback = lambda ids, done, total: send(Progress(ids, done, total))
    runner = StepRunner(pipeline, lambda partial: send(Partial(partial)), options.decode_overlap)
    conn.send(Ready(pipeline.spec(), os.getpid()))
    try:
        while True:
            try:
                message = unpack(conn.recv())
            except EOFError:
                return  # the parent is gone
            if isinstance(message, Stop):
                return
            send(_run(pipeline, runner, message, flags))
    finally:
        runner.close()


def _run(pipeline: Any, runner: StepRunner, message: RunBatch | RunStep, flags: list[Any]) -> Done | Failed:
    try:
        if isinstance(message, RunBatch):
            pipeline.interrupt = flags[message.interrupt]
            output = run_batch(pipeline, message.batch)
        else:
            output = runner.run(message.plan, flags[message.attention])
        # A request's error goes back to the parent as it is, if it pickles.
        output.errors = {request_id: _picklable(error) for request_id, error in output.errors.items()}
        return Done(message.call_id, output)
    except Exception as exc:
        logger.exception("run %d failed", message.call_id)
        return Failed(message.call_id, _picklable(exc))


def _picklable(exc: Exception) -> Exception:
    import pickle

    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:  # noqa: BLE001 - any exception may refuse pickling
        return RuntimeError(f"{type(exc).__name__}: {exc}")
    return exc
