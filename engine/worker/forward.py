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
from engine.worker.moderation import ModeratedPipeline, moderate_outputs

logger = logging.getLogger(__name__)


class PipelineCounters(Protocol):
    """What a pipeline counts as it runs, each a running total read before and after every
    forward and step, whose differences go to `/metrics` (`BatchOutput`, `ForwardRecord`).
    `pipelines.base.Pipeline` counts nothing; its adapters count what their parts do."""

    def prompt_cache_counts(self) -> dict[str, float] | None:
        """The prompt-embedding cache's counts (hits, misses, evictions, encode_seconds,
        bytes, entries; `pipelines.prompt_cache`), or None without one."""
        ...

    def cache_blocks_skipped(self) -> int:
        """Denoiser blocks its requests skipped under their cache (`pipelines.cache`)."""
        ...

    def decode_out_of_memory(self) -> int:
        """Decodes its VAE halved after running out of memory (`pipelines.decode`)."""
        ...

    def compiled_graphs(self) -> int:
        """Graphs its compiled denoiser has compiled (`pipelines.denoiser.compiling`)."""
        ...


class ForwardPipeline(PipelineCounters, ModeratedPipeline, Protocol):
    def forward(self, batch: RequestBatch) -> list[RequestOutput]: ...


def run_batch(pipeline: ForwardPipeline, batch: RequestBatch) -> BatchOutput:
    result = BatchOutput()
    halved = pipeline.decode_out_of_memory()
    _run(pipeline, batch, result)
    # Every output of the batch at once, however many forwards isolating a failure took.
    moderate_outputs(pipeline, {r.request_id: r for r in batch.requests}, result)
    result.decode_out_of_memory = pipeline.decode_out_of_memory() - halved
    result.prompt_cache = pipeline.prompt_cache_counts()
    return result


def _run(pipeline: ForwardPipeline, batch: RequestBatch, result: BatchOutput) -> None:
    issued, start, compiled = time.monotonic(), time.perf_counter(), pipeline.compiled_graphs()
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
                request_ids=tuple(batch.request_ids),
                started=issued,
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
        result.forwards.append(_record(batch, issued, start, ok=False, out_of_memory=is_out_of_memory(exc)))
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
    result.forwards.append(
        replace(_record(batch, issued, start, ok=True), compiles=pipeline.compiled_graphs() - compiled)
    )
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


def _record(
    batch: RequestBatch, issued: float, start: float, *, ok: bool, out_of_memory: bool = False
) -> ForwardRecord:
    """`issued`: `time.monotonic()` at its start (the request's timeline), `start` the
    `perf_counter` reading its seconds are measured from."""
    return ForwardRecord(
        len(batch),
        batch.num_images,
        time.perf_counter() - start,
        ok,
        out_of_memory=out_of_memory,
        adapter=adapter_of(batch.requests),
        steps=_steps(batch),
        request_ids=tuple(batch.request_ids),
        started=issued,
    )


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
