"""Hand-made pipelines and requests for engine tests: no torch, no model."""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Self

from engine.request import (
    BatchKey,
    ForwardInterrupted,
    GenerationRequest,
    InvalidRequestError,
    RequestBatch,
    RequestOutput,
    SamplingParams,
    preview_steps,
)
from pipelines.base import Pipeline, PipelineConfig


def make_request(
    request_id: str,
    *,
    arrival: float = 0.0,
    n: int = 1,
    size: int = 64,
    steps: int = 4,
    guidance: float = 7.5,
    prompt: str = "a cat",
    seed: int | None = 0,
    partial_images: int = 0,
) -> GenerationRequest:
    params = SamplingParams(
        width=size,
        height=size,
        num_inference_steps=steps,
        guidance_scale=guidance,
        n=n,
        seed=seed,
        partial_images=partial_images,
    )
    return GenerationRequest(request_id=request_id, prompt=prompt, params=params, arrival_time=arrival)


class FakePipeline(Pipeline):
    """Echoes (prompt, seed) per image; fails requests whose prompt contains "FAIL".

    `gate`, when set, holds every forward until the test releases it, so a test can act
    while a batch is running.
    """

    supports_request_batch: ClassVar[bool] = True

    def __init__(self) -> None:
        self.forwards: list[list[str]] = []
        self.gate: threading.Event | None = None
        self.started = threading.Event()

    @classmethod
    def load(cls, config: PipelineConfig) -> Self:
        return cls()

    def resolve(self, request: GenerationRequest) -> SamplingParams:
        # Like a real model: a default size (64x64) for requests that name none.
        params = request.params
        return replace(params, width=params.width or 64, height=params.height or 64)

    def validate(self, params: SamplingParams) -> None:
        if params.width is not None and params.width > 1024:
            raise InvalidRequestError("width too large", "width")

    def batch_key(self, request: GenerationRequest) -> BatchKey:
        params = request.params
        return (params.width, params.height, params.num_inference_steps, params.guidance_scale)

    def forward(self, batch: RequestBatch) -> list[RequestOutput]:
        self.forwards.append(batch.request_ids)
        self.started.set()
        if self.gate is not None:
            self.gate.wait(timeout=10)
        if any("FAIL" in r.prompt for r in batch.requests):
            raise RuntimeError("marked request failed")
        return [
            RequestOutput(
                request_id=r.request_id,
                images=tuple((r.prompt, s) for s in r.params.image_seeds()),
                seeds=tuple(r.params.image_seeds()),
            )
            for r in batch.requests
        ]


class FakeDenoisingPipeline(FakePipeline):
    """A forward of `num_inference_steps` steps, each taking a permit the test releases, that
    honours `interrupt` at each step's end as the diffusers step callback does."""

    def __init__(self) -> None:
        super().__init__()
        self.permits = threading.Semaphore(0)
        self.steps_taken = 0

    def forward(self, batch: RequestBatch) -> list[RequestOutput]:
        self.started.set()
        for _ in range(batch.requests[0].params.num_inference_steps or 1):
            self.permits.acquire(timeout=10)
            self.steps_taken += 1
            if self.interrupt is not None and self.interrupt.is_set():
                raise ForwardInterrupted
        return super().forward(batch)


class FakeInputPipeline(FakePipeline):
    """Takes one input image per request (as edits and image-to-video do)."""

    input_image_count: ClassVar[tuple[int, int]] = (1, 1)


class FakeMemoryPipeline(FakePipeline):
    """Runs out of memory with more than `fits` images in one forward."""

    def __init__(self, fits: int) -> None:
        super().__init__()
        self.fits = fits
        self.attempts: list[int] = []

    def forward(self, batch: RequestBatch) -> list[RequestOutput]:
        self.attempts.append(batch.num_images)
        if batch.num_images > self.fits:
            raise MemoryError("out of memory (fake)")
        return super().forward(batch)


class FakeSerialPipeline(FakePipeline):
    supports_request_batch: ClassVar[bool] = False


@dataclass(eq=False)
class FakeState:
    request: GenerationRequest
    total_steps: int
    steps_done: int = 0
    preview: Any = None
    previews_sent: int = 0

    @property
    def is_done(self) -> bool:
        return self.steps_done >= self.total_steps

    @property
    def num_images(self) -> int:
        return self.request.params.n


class StepCounter:
    """Steps taken, which another thread can wait for."""

    def __init__(self) -> None:
        self._count = 0
        self._changed = threading.Condition()

    def add(self) -> None:
        with self._changed:
            self._count += 1
            self._changed.notify_all()

    def wait_for(self, count: int, timeout: float) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: self._count >= count, timeout)


class FakeStepPipeline(FakePipeline):
    """Steps requests together like a real stepping pipeline, recording every step group.

    A request whose prompt contains "FAIL" makes any step it is in raise ("PREVIEWFAIL": its
    preview decode instead). Previews (`partial_images`) are (prompt, "preview", steps done)
    at the steps `preview_steps` picks. With `permits`
    set, each step takes one permit first (a test releases them one by one) and sets
    `entered` while it waits for it.
    """

    supports_step_batch: ClassVar[bool] = True

    def __init__(self) -> None:
        super().__init__()
        self.permits: threading.Semaphore | None = None
        self.entered = threading.Event()
        self.groups: list[list[str]] = []
        self.prepared: list[str] = []
        self.finished: list[list[str]] = []
        # How many steps had run when each `finished` entry was decoded.
        self.finished_after: list[int] = []
        # With `finish_gate` set, each decode waits for it first (a test holds decodes).
        self.finish_gate: threading.Event | None = None
        self.steps_taken = StepCounter()

    def step_key(self, request: GenerationRequest) -> BatchKey:
        return (request.params.width, request.params.height)

    def prepare(self, requests: list[GenerationRequest]) -> list[Any]:
        self.prepared.extend(r.request_id for r in requests)
        return [FakeState(r, r.params.num_inference_steps or 1) for r in requests]

    def step(self, states: list[Any]) -> None:
        self.entered.set()
        if self.permits is not None:
            self.permits.acquire(timeout=10)
        if any("FAIL" in s.request.prompt and "PREVIEW" not in s.request.prompt for s in states):
            raise RuntimeError("marked request failed")
        self.groups.append([s.request.request_id for s in states])
        self.steps_taken.add()
        for state in states:
            state.steps_done += 1
            if state.steps_done in preview_steps(state.total_steps, state.request.params.partial_images):
                state.preview = (state.request.prompt, "preview", state.steps_done)

    def preview(self, states: list[Any]) -> list[tuple[Any, ...]]:
        if any("PREVIEWFAIL" in s.request.prompt for s in states):
            raise RuntimeError("marked preview failed")
        return [tuple(s.preview for _ in range(s.request.params.n)) for s in states]

    def finish(self, states: list[Any]) -> list[RequestOutput]:
        if self.finish_gate is not None:
            self.finish_gate.wait(timeout=10)
        self.finished.append([s.request.request_id for s in states])
        self.finished_after.append(len(self.groups))
        return [
            RequestOutput(
                request_id=s.request.request_id,
                images=tuple((s.request.prompt, seed) for seed in s.request.params.image_seeds()),
                seeds=tuple(s.request.params.image_seeds()),
            )
            for s in states
        ]


class FakeMemoryStepPipeline(FakeStepPipeline):
    """A stepping pipeline whose steps run out of memory above `fits` images; records the
    images of every step it was asked for."""

    def __init__(self, fits: int) -> None:
        super().__init__()
        self.fits = fits
        self.attempts: list[int] = []

    def step(self, states: list[Any]) -> None:
        images = sum(s.num_images for s in states)
        self.attempts.append(images)
        if images > self.fits:
            raise MemoryError("out of memory (fake)")
        super().step(states)
