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

from engine.request import GenerationRequest, InvalidRequestError, SamplingParams
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
    """Step dummy requests once per group of `denoiser.warmup_requests` (after a single
    request without guidance) at the model's default size, then a group of the largest
    count at each of `denoiser.warmup_sizes`, timing the compiles."""
    if denoiser.compile == "off":
        return WarmupResult(reason="--compile off")
    if not getattr(pipeline, "supports_step_batch", False) or pipeline.input_image_count[0] > 0:
        why = "the pipeline has no step stages for text-only requests: the first requests compile"
        return _told(WarmupResult(reason=why))
    start, before = time.perf_counter(), compiled_graphs()
    groups = [_requests(pipeline, 1, guided=False)]
    groups += [_requests(pipeline, count) for count in denoiser.warmup_requests]
    most = max(denoiser.warmup_requests, default=1)
    groups += [_requests(pipeline, most, size=size) for size in denoiser.warmup_sizes]
    for group in groups:
        if group:
            pipeline.step(pipeline.prepare(group))
    result = WarmupResult(compiled_graphs() - before, time.perf_counter() - start)
    return _told(result)


def _requests(
    pipeline: Any, count: int, guided: bool = True, size: tuple[int, int] | None = None
) -> list[GenerationRequest]:
    """`count` dummy requests at the model's defaults (`size`: width and height instead);
    unguided: guidance off (scale 1). None where the model refuses them."""
    made = []
    width, height = size or (None, None)
    for seed in range(count):
        params = SamplingParams(seed=seed, num_inference_steps=2, width=width, height=height)
        if not guided:
            params = dataclasses.replace(params, guidance_scale=1.0, true_cfg_scale=1.0, negative_prompt=None)
        request = GenerationRequest.create("a compile warm-up", params)
        try:
            resolved = pipeline.resolve(request)
            if not guided:  # a model default negative prompt would switch true CFG back on
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
