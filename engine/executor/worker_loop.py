"""The worker process of `ProcessExecutor`: one pipeline, driven by small typed messages.

The parent sends `RunBatch` / `RunStep` / `Stop` through a pipe; the worker answers each
run with `Done` (a `BatchOutput`) or `Failed` (the executor itself broke), and sends
`Progress` and `Partial` (a preview) as they happen. Every large array in a message, either
way, travels through shared memory (`engine.executor.shm`). What the worker sends goes pickled
inside an `Envelope` that names the run it ends and the segments it holds, so that a
message the parent cannot read still fails its run and frees its segments. The engine's
two flags (the forward's `interrupt`, step mode's `attention`) are shared with the parent,
named in each run by their index.

The worker ends on `Stop`, when the parent's end of the pipe closes, or as soon as the
parent process is gone (whatever the worker is doing: nobody would read its answer).

This module runs in the child; only `serve` touches the pipeline (and so torch).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import signal
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

from engine.executor.shm import Packer, discard, shared_names, unlink, unpack, worker_prefix
from engine.logs import LogFormat, configure_logging
from engine.outputs import BatchOutput
from engine.request import PartialImage, RequestBatch
from engine.sched.step_plan import StepPlan
from engine.spec import PipelineSpec
from engine.worker.decoding import DecodeOverlap
from engine.worker.forward import run_batch
from engine.worker.pipeline import HostedPipeline, LoadReport, Measure
from engine.worker.stepping import StepRunner

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
    spec: PipelineSpec  # the pipeline's `spec()`: its pure calls, without weights
    report: LoadReport  # what `WorkerOptions.measure` found of it
    pid: int


@dataclass(frozen=True, slots=True)
class LoadFailed:
    message: str
    # The setting the loader refused, when it refused one (its error's `flag`).
    flag: str | None = None


class SettingRefusedError(ValueError):
    """A setting a worker's loader refused: `flag` names it and the message starts with it,
    as the loaders' own errors (`MemorySettingError`, ...) do where the pipeline loads in the
    server's process; the server ends on it with that one line."""

    def __init__(self, message: str, flag: str) -> None:
        super().__init__(message)
        self.flag = flag


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
class Envelope:
    """How every message from the worker travels: its pickle, with what the parent needs
    if that cannot be read — the run it ends (`Done`, `Failed`; else None) and the
    shared-memory segments it names."""

    call_id: int | None
    segments: tuple[str, ...]
    payload: bytes


def opened(envelope: Envelope) -> Any:
    """The message in `envelope` (the parent's side), its arrays copied out of shared memory
    and their segments unlinked; if it cannot be read, its segments are unlinked all the
    same, then it raises."""
    try:
        return unpack(pickle.loads(envelope.payload))
    except BaseException:
        unlink(envelope.segments)
        raise


@dataclass(frozen=True, slots=True)
class WorkerOptions:
    """What the worker needs besides its pipeline config (picklable, for spawn): `measure`
    says what the engine is told of the pipeline once loaded (None: nothing measured)."""

    decode_overlap: DecodeOverlap = "off"
    log_level: int = logging.INFO
    measure: Measure | None = None
    log_format: LogFormat = "text"
    # One step per `RunStep`, whatever the attention flag says: a member of a lane of several
    # devices (`engine.executor.lane_group`) must take exactly the steps the others take.
    step_once: bool = False


def serve(load: Any, options: WorkerOptions, conn: Connection, flags: list[Any]) -> None:
    """The worker's main: load the pipeline with `load()`, then run what the parent sends
    until `Stop` or until the parent's end of the pipe closes."""
    if options.log_format == "json":  # its lines share the server's stderr: JSON too
        configure_logging("json", options.log_level)
    else:
        logging.basicConfig(level=options.log_level, format="%(asctime)s %(levelname)s worker: %(message)s")
    # The parent stops workers with Stop, or kills them; Ctrl-C in a terminal reaches the
    # whole process group, and the parent decides what happens then.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _exit_with_parent()
    channel = _Channel(conn)
    try:
        _serve(load, options, channel, flags)
    except ServerGoneError:
        logger.info("the server is gone; worker process %d exits", os.getpid())


def _serve(load: Any, options: WorkerOptions, channel: _Channel, flags: list[Any]) -> None:
    try:
        pipeline: HostedPipeline = load()
        report = LoadReport() if options.measure is None else options.measure(pipeline)
    except Exception as exc:
        flag = getattr(exc, "flag", None)
        if isinstance(flag, str):  # a setting refused: its message says it all (the server logs it)
            channel.send(LoadFailed(str(exc), flag))
        else:
            logger.exception("loading the pipeline failed")
            channel.send(LoadFailed(f"{type(exc).__name__}: {exc}"))
        return
    ready = _ready(pipeline, report)
    channel.send(ready)
    if isinstance(ready, LoadFailed):
        pipeline.close()
        return
    pipeline.progress_callback = lambda ids, done, total: channel.send(Progress(ids, done, total))
    runner = StepRunner(pipeline, lambda partial: channel.send(Partial(partial)), options.decode_overlap)
    try:
        while True:
            try:
                message = channel.conn.recv()
            except (EOFError, OSError):
                return  # the parent is gone
            if isinstance(message, Stop):
                return
            try:
                message = unpack(message)
            except Exception as exc:  # its input images are gone: that run fails, not the worker
                logger.exception("could not read run %d", message.call_id)
                reason = RuntimeError(f"the worker could not read its inputs: {exc}")
                channel.send(Failed(message.call_id, reason))
                continue
            channel.send(_run(pipeline, runner, message, flags, step_once=options.step_once))
    finally:
        runner.close()
        pipeline.close()


def _ready(pipeline: HostedPipeline, report: LoadReport) -> Ready | LoadFailed:
    """`Ready`, or why it cannot be sent: a `Ready` that does not pickle (a pipeline whose
    `spec()` holds a lock, say) would be dropped by `_Channel.send` as a lost report, and
    the parent would wait out its start timeout for it; the start fails at once instead."""
    try:
        ready = Ready(pipeline.spec(), report, os.getpid())
        pickle.dumps(ready, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        logger.exception("the worker cannot send its Ready")
        return LoadFailed(
            f"the worker cannot send its Ready (spec() and its load report): {type(exc).__name__}: {exc}"
        )
    return ready


class ServerGoneError(Exception):
    """The parent's end of the pipe is closed: nobody reads what this worker sends."""


class _Channel:
    """The worker's end of the pipe. `send` packs large arrays into shared memory and sends
    the message in an `Envelope`, from any thread (progress and previews may come from
    others); a message that cannot be packed or pickled frees its segments, and a run's
    result that cannot becomes that run's `Failed`."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._packer = Packer(worker_prefix())
        self._lock = threading.Lock()

    def send(self, message: Any) -> None:
        call_id = message.call_id if isinstance(message, Done | Failed) else None
        packed: Any = None
        try:
            packed = self._packer.pack(message)  # (if this fails, it has unlinked its segments)
            payload = pickle.dumps(packed, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:
            if packed is not None:
                discard(packed)
            logger.exception("could not send a %s to the server", type(message).__name__)
            if call_id is None:
                return  # a progress report or a preview is lost; the run goes on
            reason = RuntimeError(f"the worker could not send its result: {type(exc).__name__}: {exc}")
            packed = Failed(call_id, reason)
            payload = pickle.dumps(packed, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            with self._lock:
                self.conn.send(Envelope(call_id, tuple(shared_names(packed)), payload))
        except OSError as exc:  # BrokenPipeError, ConnectionResetError: the parent is gone
            discard(packed)
            raise ServerGoneError from exc


def _exit_with_parent() -> None:
    """End this process as soon as its parent is gone, whatever it is doing (loading a model
    for minutes, say): a watcher thread waits on the parent's sentinel."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        wait([parent.sentinel])
        logger.warning("the server process is gone; worker process %d exits", os.getpid())
        os._exit(0)

    threading.Thread(target=watch, name="diffbatch-parent-watch", daemon=True).start()


def _run(
    pipeline: HostedPipeline,
    runner: StepRunner,
    message: RunBatch | RunStep,
    flags: list[Any],
    *,
    step_once: bool = False,
) -> Done | Failed:
    try:
        if isinstance(message, RunBatch):
            pipeline.interrupt = flags[message.interrupt]
            output = run_batch(pipeline, message.batch)
        else:
            # No flag: the runner returns after one step (`StepRunner.run`).
            output = runner.run(message.plan, None if step_once else flags[message.attention])
        # A request's error goes back to the parent as it is, if it pickles.
        output.errors = {request_id: _picklable(error) for request_id, error in output.errors.items()}
        return Done(message.call_id, output)
    except Exception as exc:
        logger.exception("run %d failed", message.call_id)
        return Failed(message.call_id, _picklable(exc))


def _picklable(exc: Exception) -> Exception:
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:  # noqa: BLE001 - any exception may refuse pickling
        return RuntimeError(f"{type(exc).__name__}: {exc}")
    return exc
