"""Request mode: diffusers' own First-Block Cache hooks over one pipeline call.

Every row of a request-level batch follows one schedule, so diffusers' hook — one decision
per forward for the whole batch — fits as it is; the cache choice is in the batch key, and
the hooks are put on for the call and taken off after it (their state starts empty each
call). A request's image can then depend on its batch peers (the decision reads all rows):
step mode's per-request cache (`pipelines.cache.first_block`) is the one that does not.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from diffusers.hooks import FirstBlockCacheConfig

from engine.request import CacheChoice
from pipelines.cache.choice import effective
from pipelines.cache.taylor_seer import whole_batch_config


@contextmanager
def whole_batch_cache(denoiser: Any, choice: CacheChoice | None) -> Iterator[None]:
    """diffusers' First-Block Cache on `denoiser` while inside, if `choice` caches."""
    choice = effective(choice)
    if choice is None or denoiser is None:
        yield
        return
    if choice.mode == "taylorseer":
        denoiser.enable_cache(whole_batch_config(choice))
    else:
        denoiser.enable_cache(FirstBlockCacheConfig(threshold=choice.threshold))
    try:
        # The hooks keep their state per cache context: pipelines that set none of their own
        # (FLUX img2img, Kontext, SD3) run in this one; those that do (cond / uncond) in theirs.
        with denoiser.cache_context("batch"):
            yield
    finally:
        denoiser.disable_cache()
