"""Custom pipeline classes loaded by `module:Class`, as a user's own would be."""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import Any, ClassVar, Self

import numpy as np
import torch

from engine.request import ForwardInterrupted, GenerationRequest, RequestBatch, RequestOutput
from pipelines.adapter import DiffusersAdapter
from pipelines.base import Pipeline, PipelineConfig
from pipelines.decode import HalvingDecode
from pipelines.families.stable_diffusion import StableDiffusion
from pipelines.families.wan import Wan
from tests.polling import wait_while_load_held


class MarkedFailurePipeline(DiffusersAdapter):
    """The real tiny pipeline, except that a forward holding a prompt with FAIL raises."""

    def forward(self, batch: RequestBatch) -> list[RequestOutput]:
        if any("FAIL" in request.prompt for request in batch.requests):
            raise RuntimeError("this request is marked to fail")
        return super().forward(batch)


class SerialTextToImage(DiffusersAdapter):
    """The real tiny pipeline, declared unable to batch requests."""

    supports_request_batch: ClassVar[bool] = False


def hold_while_gated(pipeline: Pipeline, batch: RequestBatch) -> None:
    """If a prompt of `batch` says HOLD, create `<gate>.entered` (and `<gate>.entered-<pid>`,
    naming the worker process that holds it), then wait until the file
    named by DIFFBATCH_TEST_GATE exists, honouring the engine's interrupt as a denoising
    loop does between steps."""
    if not any("HOLD" in request.prompt for request in batch.requests):
        return
    gate = Path(os.environ["DIFFBATCH_TEST_GATE"])
    gate.with_suffix(".entered").touch()  # a test can see that the engine is held
    gate.with_suffix(f".entered-{os.getpid()}").touch()
    deadline = time.monotonic() + 600
    while not gate.exists() and time.monotonic() < deadline:
        if pipeline.interrupt is not None and pipeline.interrupt.is_set():
            raise ForwardInterrupted
        time.sleep(0.01)


class GatedTextToImage(MarkedFailurePipeline):
    """The real tiny pipeline, except that a forward holding a prompt with HOLD waits for a
    gate file (`hold_while_gated`): end-to-end tests keep the engine busy for as long as
    they need, whatever the speed of the machine."""

    def forward(self, batch: RequestBatch) -> list[RequestOutput]:
        hold_while_gated(self, batch)
        return super().forward(batch)


class GatedPrepareTextToImage(DiffusersAdapter, family=StableDiffusion, serves="StableDiffusionPipeline"):
    """Stable Diffusion text-to-image whose HOLD prompts wait for the gate in step-level
    batching too (`hold_while_gated` in prepare: an abort meanwhile counts at once, the
    request leaves once the gate opens), so a test holds the engine on a server that keeps
    its default batching and its previews."""

    def forward(self, batch: RequestBatch) -> list[RequestOutput]:
        hold_while_gated(self, batch)
        return super().forward(batch)

    def prepare(self, requests: list[GenerationRequest]) -> list[Any]:
        hold_while_gated(self, RequestBatch((), tuple(requests)))
        return super().prepare(requests)


class SlowLoadingTextToImage(GatedTextToImage):
    """`GatedTextToImage` whose load waits while the file `<gate>.hold-load` exists (after
    creating `<gate>.loading-<pid>`): a test holds a worker "loading" for as long as it
    needs (a restart, a Ray replica replacing a killed one) and sees it loading."""

    @classmethod
    def load(cls, config: PipelineConfig) -> Self:
        wait_while_load_held(Path(os.environ["DIFFBATCH_TEST_GATE"]))
        return super().load(config)


class GatedImageToImage(DiffusersAdapter, family=StableDiffusion, serves="StableDiffusionImg2ImgPipeline"):
    """Stable Diffusion image-to-image (tiny-sd's weights: the cheapest model that takes an
    input image) with the same HOLD gate."""

    def forward(self, batch: RequestBatch) -> list[RequestOutput]:
        hold_while_gated(self, batch)
        return super().forward(batch)


class GatedWanTextToVideo(DiffusersAdapter, family=Wan, serves="WanPipeline"):
    """Wan text-to-video with the same HOLD gate, for video jobs."""

    def forward(self, batch: RequestBatch) -> list[RequestOutput]:
        hold_while_gated(self, batch)
        return super().forward(batch)


class DecodeLimitedTextToImage(DiffusersAdapter, family=StableDiffusion, serves="StableDiffusionPipeline"):
    """The real tiny pipeline, except that its VAE runs out of memory (`torch.OutOfMemoryError`)
    decoding more than `decode_limit` images at once; `denoised_rows` counts the rows its
    UNet has denoised, summed over every call."""

    decode_limit: ClassVar[int] = 1

    def __init__(self, pipe: Any, config: PipelineConfig) -> None:
        self.denoised_rows = 0
        decode = pipe.vae.decode
        inner = decode.inner if isinstance(decode, HalvingDecode) else decode

        def limited(latents: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if latents.shape[0] > self.decode_limit:
                raise torch.OutOfMemoryError(f"decoding {latents.shape[0]} images ran out of memory")
            return inner(latents, *args, **kwargs)

        def count(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            sample = args[0] if args else kwargs["sample"]
            self.denoised_rows += sample.shape[0]

        if isinstance(decode, HalvingDecode):  # the loader's (it holds --decode-budget): fail inside it
            decode.inner = limited
        else:
            pipe.vae.decode = limited
        pipe.unet.register_forward_pre_hook(count, with_kwargs=True)
        super().__init__(pipe, config)


# The colour `tiny-safety-checker` flags (`pipelines.tiny.safety_checker.FLAGGED_COLOUR`).
RED = (255, 0, 0)


def _red_if_asked(prompt: str, images: tuple[Any, ...]) -> tuple[Any, ...]:
    if "RED" not in prompt:
        return images
    return tuple(np.full_like(image, RED) if image.ndim == 3 else image for image in images)


class RedPaintingTextToImage(DiffusersAdapter, family=StableDiffusion, serves="StableDiffusionPipeline"):
    """The real tiny pipeline in both batching modes, except that the images and previews of a
    prompt with RED come out pure red, which `tiny-safety-checker` flags (a stand-in for a
    model that drew what a safety checker must stop), a prompt with FAIL fails, and one with
    HOLD waits for the gate file (`hold_while_gated`)."""

    def prepare(self, requests: list[GenerationRequest]) -> list[Any]:
        hold_while_gated(self, RequestBatch(key=(), requests=tuple(requests)))
        if any("FAIL" in request.prompt for request in requests):
            raise RuntimeError("this request is marked to fail")
        return super().prepare(requests)

    def forward(self, batch: RequestBatch) -> list[RequestOutput]:
        hold_while_gated(self, batch)
        if any("FAIL" in request.prompt for request in batch.requests):
            raise RuntimeError("this request is marked to fail")
        outputs = super().forward(batch)
        return [_painted(request.prompt, o) for request, o in zip(batch.requests, outputs, strict=True)]

    def finish(self, states: list[Any]) -> list[RequestOutput]:
        outputs = super().finish(states)
        return [_painted(state.request.prompt, o) for state, o in zip(states, outputs, strict=True)]

    def preview(self, states: list[Any]) -> list[tuple[Any, ...]]:
        previews = super().preview(states)
        return [_red_if_asked(s.request.prompt, p) for s, p in zip(states, previews, strict=True)]


def _painted(prompt: str, output: RequestOutput) -> RequestOutput:
    return dataclasses.replace(output, images=_red_if_asked(prompt, output.images))
