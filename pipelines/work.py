"""The work budget of one request: how much denoising it may ask for.

Work is n x frames x width x height x steps ("pixel-steps"): what a request costs grows
with each, and a request that multiplies them all (a minute of 2048x2048 video at 1000
steps) could hold the accelerator for hours. It is checked at admission, so such a
request is refused at once, with the figures, instead of queued.
"""

from __future__ import annotations

import math

from engine.request import InvalidRequestError, SamplingParams

# Without a configured budget a request may ask for this many times the work of the
# model's default request (default size, steps and frames, n = 1): room for n = 10 at the
# default size with 50% more steps, or a 4x larger image, but not 1000 steps.
DEFAULT_WORK_MULTIPLE = 16


def request_work(params: SamplingParams) -> int:
    """n x frames x width x height x steps of resolved `params`."""
    frames = params.num_frames or 1
    return params.n * frames * (params.width or 0) * (params.height or 0) * (params.num_inference_steps or 0)


def check_work(params: SamplingParams, budget: int, default: SamplingParams) -> None:
    """Refuse `params` above `budget`, naming the field that grew most over `default`."""
    work = request_work(params)
    if work <= budget:
        return
    growth = {
        "num_inference_steps": (params.num_inference_steps or 0) / (default.num_inference_steps or 1),
        "size": (params.width or 0) * (params.height or 0) / ((default.width or 1) * (default.height or 1)),
        "n": params.n / default.n,
    }
    if params.num_frames is not None:
        growth["seconds"] = params.num_frames / (default.num_frames or 1)
    param = max(growth, key=lambda name: growth[name])
    frames = f" x {params.num_frames} frames" if params.num_frames is not None else ""
    raise InvalidRequestError(
        f"this request asks for {work:,} pixel-steps (n={params.n}{frames} x {params.width}x{params.height} "
        f"x {params.num_inference_steps} steps), over this server's per-request work budget of "
        f"{budget:,} (--max-request-work); lower {param.replace('num_inference_steps', 'the steps')}",
        param,
    )


# Step counts of the quality tiers, as shares of the model's default (its "high"). A tier
# never goes below 2 steps: one step is degenerate for most schedulers (Qwen-Image refuses it).
_QUALITY_SHARE = {"low": 0.25, "medium": 0.5, "high": 1.0}


def steps_for_quality(default_steps: int, quality: str) -> int:
    """The step count of `quality` on a model whose default is `default_steps`."""
    return max(min(2, default_steps), math.ceil(default_steps * _QUALITY_SHARE[quality]))
