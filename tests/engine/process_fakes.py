"""A fake pipeline for worker processes: picklable, no torch, quick to start, and with
arrays large enough to travel through shared memory; results the server cannot read, and
a load a test can hold."""

from __future__ import annotations

import asyncio
import os
import pickle
import threading
import time
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from engine.request import GenerationRequest, RequestBatch, RequestOutput
from tests.engine.fakes import FakeStepPipeline
from tests.polling import wait_while_load_held

SIDE = 160  # 160x160x3 uint8 = 75 KiB: above engine.executor.shm.SHM_MIN_BYTES
GATE_ENV = "DIFFBATCH_TEST_GATE"


def image_for(request: GenerationRequest, seed: int) -> np.ndarray:
    """What the fake makes for one image: the input image itself for requests with one,
    else pixels drawn from the seed (so a test knows every byte to expect)."""
    if request.input_images:
        return np.asarray(request.input_images[0])
    return np.random.default_rng(seed).integers(0, 256, (SIDE, SIDE, 3), dtype=np.uint8)


class ArrayPipeline(FakeStepPipeline):
    """Steps like `FakeStepPipeline`, and returns real arrays in both modes.

    A prompt containing "HOLD" blocks its forward (or step) until the file named by
    $DIFFBATCH_TEST_GATE exists, after creating `<gate>.entered` and `<gate>.entered-<pid>`:
    a test knows the worker (which one, with several) is busy with it, and can kill it there.
    A request whose prompt contains "UNREADABLE" gets an output the server cannot unpickle
    ("UNREADABLE ONCE": only the first time this worker makes it).
    """

    input_image_count: ClassVar[tuple[int, int]] = (0, 1)
    _spoiled: ClassVar[set[str]] = set()

    def __getstate__(self) -> dict[str, Any]:
        # `spec()` is the pipeline itself: its locks and events stay behind.
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]

    def forward(self, batch: RequestBatch) -> list[RequestOutput]:
        self._hold([r.prompt for r in batch.requests])
        super().forward(batch)  # records it; raises for FAIL
        return [self._output(r) for r in batch.requests]

    def step(self, states: list[Any]) -> None:
        self._hold([s.request.prompt for s in states])
        super().step(states)

    def preview(self, states: list[Any]) -> list[tuple[Any, ...]]:
        super().preview(states)
        return [
            tuple(np.full((SIDE, SIDE, 3), s.steps_done, np.uint8) for _ in range(s.num_images))
            for s in states
        ]

    def finish(self, states: list[Any]) -> list[RequestOutput]:
        super().finish(states)
        return [self._output(s.request) for s in states]

    @classmethod
    def _output(cls, request: GenerationRequest) -> RequestOutput:
        seeds = tuple(request.params.image_seeds())
        images = tuple(image_for(request, s) for s in seeds)
        if "UNREADABLE" in request.prompt:
            once = "ONCE" in request.prompt
            if not once or request.request_id not in cls._spoiled:
                cls._spoiled.add(request.request_id)
                return RequestOutput(request.request_id, images, seeds, extras={"spoilt": Unreadable()})
        return RequestOutput(request.request_id, images, seeds)

    @staticmethod
    def _hold(prompts: list[str]) -> None:
        if not any("HOLD" in p for p in prompts):
            return
        gate = Path(os.environ[GATE_ENV])
        gate.with_suffix(".entered").touch()
        gate.with_suffix(f".entered-{os.getpid()}").touch()
        deadline = time.monotonic() + 60
        while not gate.exists() and time.monotonic() < deadline:
            time.sleep(0.02)


def _refuse() -> None:
    raise pickle.UnpicklingError("this object cannot be read back")


class Unreadable:
    """Pickles in the worker, fails to unpickle in the server (as an object of a class the
    server cannot import, or a broken `__reduce__`, would)."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (_refuse, ())


def slow_loading_pipeline() -> ArrayPipeline:
    """`ArrayPipeline`, loaded after waiting while the file `<gate>.hold-load` exists (having
    created `<gate>.loading-<pid>`): a test holds a worker "loading" for as long as it needs."""
    wait_while_load_held(Path(os.environ[GATE_ENV]))
    return ArrayPipeline()


class _HoldsALock:
    def __init__(self) -> None:
        self.lock = threading.Lock()  # cannot be pickled


class UnsendableSpecPipeline(ArrayPipeline):
    """Loads, but its `spec()` cannot be pickled: the worker's `Ready` cannot be sent."""

    def spec(self) -> Any:
        return _HoldsALock()


def unsendable_spec_pipeline() -> UnsendableSpecPipeline:
    return UnsendableSpecPipeline()


class FakeWorker:
    """Stands in for a serving `WorkerProcess` in a `ProcessExecutor` (no process): it
    records each run it is sent and answers it with `answer(run)`, delivered on the event
    loop as the reader thread would; `answer` raises to refuse the send."""

    def __init__(self, executor: Any, answer: Any) -> None:
        self.executor = executor
        self.answer = answer
        self.sent: list[Any] = []
        self.loop = asyncio.get_running_loop()
        executor._loop, executor._supervisor._worker = self.loop, self
        executor.stats.alive = True

    def send(self, run: Any) -> None:
        message = self.answer(run)
        self.sent.append(run)
        self.loop.call_soon_threadsafe(self.executor._calls.settle, message)
