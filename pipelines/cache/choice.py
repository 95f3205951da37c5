"""What a request's cache choice means for a family: refused at admission where the family's
denoiser cannot be cached, and a request's First-Block Cache to start with."""

from __future__ import annotations

from engine.request import CacheChoice, InvalidRequestError, SamplingParams
from pipelines.cache.first_block import FirstBlockCache


def effective(choice: CacheChoice | None) -> CacheChoice | None:
    """The choice as it changes the computation: None when every block runs (mode none, or a
    threshold of 0), so such requests share a batch key with those that choose nothing."""
    return choice if choice is not None and choice.on else None


def check_cache(choice: CacheChoice | None, cacheable: bool) -> None:
    if choice is not None and effective(choice) is not None and not cacheable:
        raise InvalidRequestError(
            f"cache mode {choice.mode!r} is not available for this model (its denoiser's blocks are "
            "not cached here); send cache mode 'none'",
            "cache.mode",
        )


def first_block_cache(params: SamplingParams) -> FirstBlockCache | None:
    """A request's empty First-Block Cache, or None when it does not cache."""
    choice = effective(params.cache)
    return None if choice is None or choice.mode != "first-block" else FirstBlockCache(choice.threshold)
