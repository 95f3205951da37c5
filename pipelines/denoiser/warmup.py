"""The compile warm-up at start: dummy requests stepped through the pipeline's own step
stages, so the graphs a step group needs are compiled before the first user arrives.

The compiled graphs belong to the denoiser modules (`pipelines.denoiser.compiling`), shared
by whoever calls the denoiser, so the warm-up serves request-level batching too. Groups:
one request without guidance (one row: torch keeps a graph for a dimension of 1), then
groups of `warmup_requests` requests at the model's defaults (two row counts above one:
the second makes the row dimension symbolic, for every later group size).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any

from engine.request import GenerationRequest, InvalidRequestError, RequestBatch, SamplingParams
from pipelines.denoiser.compiling import compiled_graphs
from pipelines.denoiser.options import DenoiserConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class WarmupResult:
    """What the warm-up compiled (`graphs`, in `seconds`), or why it was skipped (`reason`)."""

    graphs: int = 0
    seconds: float = 0.0
    reason: str = ""


def warm_up(pipeline: Any, denoiser: DenoiserConfig) -> WarmupResult:
    """Run dummy requests once per group of `denoiser.warmup_requests` (after a single
    request without guidance) at the model's default size, then a group of the largest
    count at each of `denoiser.warmup_sizes`, timing the compiles: through the step stages
    in step mode, else through request-level forwards of one step (the two call the
    denoiser with different Python arguments, FLUX's `joint_attention_kwargs` None or {}:
    graphs of their own)."""
    if denoiser.compile == "off":
        return WarmupResult(reason="--compile off")
    if pipeline.input_image_count[0] > 0:
        why = "the model's requests bring input images: the first requests compile"
        return _told(WarmupResult(reason=why))
    stepped = denoiser.warmup_batching == "step" and getattr(pipeline, "supports_step_batch", False)
    start, before = time.perf_counter(), compiled_graphs()
    groups = [_requests(pipeline, 1, guided=False)]
    groups += [_requests(pipeline, count) for count in denoiser.warmup_requests]
    most = max(denoiser.warmup_requests, default=1)
    groups += [_requests(pipeline, most, size=size) for size in denoiser.warmup_sizes]
    for group in groups:
        if group and stepped:
            pipeline.step(pipeline.prepare(group))
        elif group:
            batches = [group] if pipeline.supports_request_batch else [[request] for request in group]
            for batch in batches:
                pipeline.forward(RequestBatch(key=pipeline.batch_key(batch[0]), requests=tuple(batch)))
    result = WarmupResult(compiled_graphs() - before, time.perf_counter() - start)
    return _told(result)


def _requests(
    pipeline: Any, count: int, guided: bool = True, size: tuple[int, int] | None = None
) -> list[GenerationRequest]:
    """`count` dummy requests at the model's defaults (`size`: width and height instead);
    unguided: guidance off (scale 1, no negative prompt: true CFG runs only with one). None
    where the model refuses them."""
    width, height = size or (None, None)
    # Steps: a request-level forward runs them all; some schedulers need two.
    params = SamplingParams(num_inference_steps=2, width=width, height=height)
    if guided:
        return _made(pipeline, count, params)
    # Models with a true CFG scale take 1 for off; the others refuse the field.
    for true_cfg in (None, 1.0):
        unguided = dataclasses.replace(params, guidance_scale=1.0, true_cfg_scale=true_cfg)
        if made := _made(pipeline, count, unguided, negative=False):
            return made
    return []


def _made(
    pipeline: Any, count: int, params: SamplingParams, negative: bool = True
) -> list[GenerationRequest]:
    made = []
    for seed in range(count):
        # Ids of its own making: the members of a lane warm up in step with one another, and
        # agree on each step by its requests' ids (`pipelines.parallel.lane_split`).
        request_id = f"warmup-{count}-{params.width}x{params.height}-{params.guidance_scale}-{seed}"
        request = GenerationRequest.create(
            "a compile warm-up", dataclasses.replace(params, seed=seed), request_id=request_id
        )
        try:
            resolved = pipeline.resolve(request)
            if not negative:  # a model's default negative prompt would switch true CFG on
                resolved = dataclasses.replace(resolved, negative_prompt=None)
            pipeline.validate(resolved)
        except InvalidRequestError:
            return []
        made.append(request.with_params(resolved))
    return made


def _told(result: WarmupResult) -> WarmupResult:
    if result.reason:
        logger.info("compile warm-up skipped: %s", result.reason)
    else:
        logger.info("compile warm-up: %d graphs compiled in %.1f s", result.graphs, result.seconds)
    return result
