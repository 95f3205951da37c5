"""Running one batch through a pipeline, with per-request fate.

This is the hardware side of the engine, run wherever the pipeline lives (an executor
thread now, a worker process later). It checks the pipeline's promise of one output per
request, and when a batched forward raises it bisects the batch and retries the halves,
so only the request that really fails gets the error and its peers still get images.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Protocol

from engine.errors import RequestAbortedError
from engine.outputs import BatchOutput, ForwardRecord
from engine.request import (
    ForwardInterrupted,
    GenerationRequest,
    InvalidRequestError,
    RequestBatch,
    RequestOutput,
    steps_to_run,
)

logger = logging.getLogger(__name__)


class ForwardPipeline(Protocol):
    def forward(self, batch: RequestBatch) -> list[RequestOutput]: ...


def run_batch(pipeline: ForwardPipeline, batch: RequestBatch) -> BatchOutput:
    result = BatchOutput()
    halved = decode_out_of_memory_of(pipeline)
    _run(pipeline, batch, result)
    result.decode_out_of_memory = decode_out_of_memory_of(pipeline) - halved
    result.prompt_cache = prompt_cache_of(pipeline)
    return result


def prompt_cache_of(pipeline: object) -> dict[str, float] | None:
    """A pipeline's prompt-cache counts (`prompt_cache_counts()`: hits, misses, evictions,
    encode_seconds, bytes, entries), if it keeps a prompt cache."""
    counts = getattr(pipeline, "prompt_cache_counts", None)
    return counts() if callable(counts) else None


def cache_blocks_skipped_of(pipeline: object) -> int:
    """The denoiser blocks a pipeline's requests skipped under its cache so far, if it counts
    them (`cache_blocks_skipped()`, `pipelines.cache`), else 0."""
    count = getattr(pipeline, "cache_blocks_skipped", None)
    return int(count()) if callable(count) else 0


def decode_out_of_memory_of(pipeline: object) -> int:
    """The decodes a pipeline's VAE halved after running out of memory so far, if it counts
    them (`decode_out_of_memory()`, `pipelines.decode.HalvingDecode`), else 0."""
    count = getattr(pipeline, "decode_out_of_memory", None)
    return int(count()) if callable(count) else 0


def compiles_of(pipeline: object) -> int:
    """Graphs a pipeline's compiled denoiser has compiled so far, if it counts them
    (`compiled_graphs()`, `pipelines.denoiser.compiling`), else 0."""
    count = getattr(pipeline, "compiled_graphs", None)
    return int(count()) if callable(count) else 0


def _run(pipeline: ForwardPipeline, batch: RequestBatch, result: BatchOutput) -> None:
    start, compiled = time.perf_counter(), compiles_of(pipeline)
    try:
        outputs = pipeline.forward(batch)
        _check_outputs(batch, outputs)
    except ForwardInterrupted:
        # Not a failure to isolate: nobody wants this batch any more.
        seconds = time.perf_counter() - start
        result.forwards.append(
            ForwardRecord(
                len(batch),
                batch.num_images,
                seconds,
                ok=True,
                interrupted=True,
                adapter=adapter_of(batch.requests),
                steps=_steps(batch),
            )
        )
        logger.info(
            "forward of %s interrupted after %.1f s: all its requests were aborted",
            batch.request_ids,
            seconds,
        )
        for request_id in batch.request_ids:
            result.errors[request_id] = RequestAbortedError(f"request {request_id} was aborted")
        return
    except Exception as exc:
        result.forwards.append(_record(batch, start, ok=False, out_of_memory=is_out_of_memory(exc)))
        if len(batch) == 1:
            request_id = batch.request_ids[0]
            if not isinstance(exc, InvalidRequestError):
                logger.exception("forward failed for request %s", request_id)
            result.errors[request_id] = exc
            return
        logger.warning(
            "batched forward of %d requests failed (%s: %s); retrying in halves to isolate it",
            len(batch),
            type(exc).__name__,
            exc,
        )
        middle = len(batch) // 2
        for part in (batch.requests[:middle], batch.requests[middle:]):
            _run(pipeline, RequestBatch(key=batch.key, requests=part), result)
        return
    result.forwards.append(replace(_record(batch, start, ok=True), compiles=compiles_of(pipeline) - compiled))
    for output in outputs:
        result.outputs[output.request_id] = output


def _check_outputs(batch: RequestBatch, outputs: list[RequestOutput]) -> None:
    got = [o.request_id for o in outputs]
    if got != batch.request_ids:
        raise RuntimeError(
            f"pipeline returned outputs for {got} but the batch was {batch.request_ids}: "
            "forward() must return exactly one RequestOutput per request, in batch order"
        )
    for request, output in zip(batch.requests, outputs, strict=True):
        if len(output.images) != request.params.n:
            raise RuntimeError(
                f"pipeline returned {len(output.images)} images for request "
                f"{request.request_id}, which asked for n={request.params.n}"
            )


def _record(batch: RequestBatch, start: float, *, ok: bool, out_of_memory: bool = False) -> ForwardRecord:
    seconds = time.perf_counter() - start
    adapter = adapter_of(batch.requests)
    steps = _steps(batch)
    return ForwardRecord(len(batch), batch.num_images, seconds, ok, False, out_of_memory, adapter, steps)


def _steps(batch: RequestBatch) -> int:
    """The denoising steps of a request-level forward (steps and strength are in the batch
    key: one for all), counted as Retry-After counts the steps ahead."""
    return steps_to_run(batch.requests[0].params)


def adapter_of(requests: Sequence[GenerationRequest]) -> str | None:
    """The LoRA adapter of a forward's requests (one: it is in every batch and step key)."""
    lora = requests[0].params.lora
    return None if lora is None else lora.name


def is_out_of_memory(exc: BaseException) -> bool:
    """Host or accelerator memory ran out (`torch.OutOfMemoryError` is named, not imported:
    the engine does not import torch)."""
    return isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError"
