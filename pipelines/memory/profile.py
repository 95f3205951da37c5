"""The profile run's two runs on a loaded pipeline (`engine.worker.profile_run.ProfileTarget`):
dummy requests of the model's default size through the pipeline's own step stages, so the
memory measured is what serving will hold (prepare's text encoder, the denoiser's rows,
the family's decode and post-processing), offload and quantization hooks included."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

from engine.request import GenerationRequest, SamplingParams
from pipelines.decode import HalvingDecode
from pipelines.memory.decode_budget import DecodeBudget
from pipelines.memory.gauge import CudaGauge


class StepProfile:
    """`adapter`: a pipeline that steps text-only requests (`supports_step_batch`, no input
    images); `profile_target` says whether one does."""

    def __init__(self, adapter: Any) -> None:
        self.adapter = adapter
        self._request = self._requests(1)[0]

    def _requests(self, count: int) -> list[GenerationRequest]:
        made = []
        for seed in range(count):
            request = GenerationRequest.create("a profile run", SamplingParams(seed=seed))
            made.append(request.with_params(self.adapter.resolve(request)))
        return made

    def request_cost(self) -> int:
        return int(self.adapter.step_cost(self._request))

    def image_pixels(self) -> int:
        params = self._request.params
        return int(params.width or 1) * int(params.height or 1) * int(params.num_frames or 1)

    def decode_images(self) -> int | None:
        halving = self._decode()
        limit = None if halving is None else halving.limit
        if not isinstance(limit, DecodeBudget):
            return None
        return max(1, limit.pixels // self.image_pixels())

    def run_step(self, requests: int) -> None:
        states = self.adapter.prepare(self._requests(requests))
        self.adapter.step(states)

    def run_decode(self, images: int) -> None:
        states = self.adapter.prepare(self._requests(images))
        with self._whole_decodes():
            self.adapter.finish(states)

    def bound_decodes(self, pixels: int) -> None:
        halving = self._decode()
        if halving is None:
            return
        if isinstance(halving.limit, DecodeBudget):
            halving.limit = dataclasses.replace(halving.limit, pixels=pixels)
        else:
            memory = dataclasses.replace(self.adapter.config.memory, decode_budget=pixels)
            halving.limit = DecodeBudget.of(self.adapter.pipe, memory)

    def _decode(self) -> HalvingDecode | None:
        decode = getattr(getattr(self.adapter.pipe, "vae", None), "decode", None)
        return decode if isinstance(decode, HalvingDecode) else None

    @contextlib.contextmanager
    def _whole_decodes(self) -> Iterator[None]:
        """The VAE's own decode for the run: `HalvingDecode` would cut it by the budget and
        halve it on running out, hiding what one decode of this many images holds."""
        halving = self._decode()
        if halving is None:
            yield
            return
        vae = self.adapter.pipe.vae
        vae.decode = halving.inner
        try:
            yield
        finally:
            vae.decode = halving


def profile_target(pipeline: Any) -> StepProfile | None:
    """The runs for `pipeline`, or None where it does not step text-only requests (request
    level only, or every request brings an input image)."""
    if not getattr(pipeline, "supports_step_batch", False) or pipeline.input_image_count[0] > 0:
        return None
    return StepProfile(pipeline)


def device_gauge(device: str) -> CudaGauge | None:
    """The device's memory gauge; None where there is none to read (the CPU: the host's
    memory is not the server's alone, and torch keeps no peak of it)."""
    return CudaGauge(device) if device.split(":", maxsplit=1)[0] == "cuda" else None
