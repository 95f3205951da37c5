"""A pipeline (for `pipeline_class`, in a thread or a worker process) whose images say
whether subnormal floats survive in the thread that runs it: red 255 where 1e-40 x 1 stays
1e-40 there, 0 where it is flushed to zero; green the same in a thread that thread starts
(as the decode thread is)."""

from __future__ import annotations

import threading
from dataclasses import replace
from typing import ClassVar, Self

import numpy as np
import torch

from engine.request import BatchKey, GenerationRequest, RequestBatch, RequestOutput, SamplingParams
from pipelines.base import Pipeline, PipelineConfig


def subnormals_kept() -> bool:
    # A tensor large enough that torch may split the product over its compute threads.
    values = torch.full((1 << 16,), 1e-40, dtype=torch.float32)
    return bool((values * 1.0 != 0).any())


class SubnormalProbe(Pipeline):
    supports_request_batch: ClassVar[bool] = True

    @classmethod
    def load(cls, config: PipelineConfig) -> Self:
        return cls()

    def resolve(self, request: GenerationRequest) -> SamplingParams:
        return replace(request.params, width=request.params.width or 8, height=request.params.height or 8)

    def validate(self, params: SamplingParams) -> None:
        pass

    def spec(self) -> SubnormalProbe:
        return SubnormalProbe()  # without the progress callback a worker sets on itself

    def batch_key(self, request: GenerationRequest) -> BatchKey:
        return (request.params.width, request.params.height)

    def forward(self, batch: RequestBatch) -> list[RequestOutput]:
        started: list[bool] = []
        thread = threading.Thread(target=lambda: started.append(subnormals_kept()))
        thread.start()
        thread.join()
        pixel = (255 * subnormals_kept(), 255 * started[0], 0)
        outputs = []
        for request in batch.requests:
            params = request.params
            image = np.zeros((params.height or 8, params.width or 8, 3), dtype=np.uint8)
            image[...] = pixel
            seeds = tuple(params.image_seeds())
            outputs.append(RequestOutput(request.request_id, images=tuple(image for _ in seeds), seeds=seeds))
        return outputs
