"""What a request's cache choice means for a family: the choice it runs with (its own, else
one its quality tier picks from the server's), refused at admission where the family's
denoiser cannot be cached, and a request's First-Block Cache to start with."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from engine.request import CacheChoice, InvalidRequestError, Quality, SamplingParams
from pipelines.cache.records import FirstBlockCache

# The threshold a server without `--cache-threshold` would have (`CacheSettings`'s
# default), for pipelines built without one.
DEFAULT_THRESHOLD = 0.1
# OpenAI's `quality: low` on a server that caches: at least this threshold. On `shapes-dit`
# 0.1 cost 0.8 points of adherence at 20 steps (docs/benchmarks.md, "Cache acceleration").
LOW_QUALITY_THRESHOLD = 0.1


def resolved(
    asked: CacheChoice | None, served: CacheChoice, quality: Quality | None, threshold: float | None = None
) -> CacheChoice:
    """The cache a request runs with. Its own choice wins (without a threshold: the server's);
    else, where the server caches (`--cache` not none), its quality tier picks a level as it
    picks steps: high runs every block, low caches at least at LOW_QUALITY_THRESHOLD, medium
    (and no tier) takes the server's. A server that does not cache never starts to."""
    served_threshold = next(
        (value for value in (threshold, served.threshold) if value is not None), DEFAULT_THRESHOLD
    )
    if asked is not None:
        if asked.mode != "first-block" or asked.threshold is not None:
            return asked
        return replace(asked, threshold=served_threshold)
    if served.mode == "first-block":
        served = replace(served, threshold=served_threshold)
    if served.mode == "none" or quality in (None, "medium"):
        return served
    if quality == "high":
        return CacheChoice("none")
    if served.mode == "taylorseer":  # low: the server's schedule (it has no threshold to raise)
        return served
    return replace(served, threshold=max(served_threshold, LOW_QUALITY_THRESHOLD))


def effective(choice: CacheChoice | None) -> CacheChoice | None:
    """The choice as it changes the computation: None when every block runs (mode none, or a
    threshold of 0), so such requests share a batch key with those that choose nothing."""
    return choice if choice is not None and choice.on else None


def check_cache(choice: CacheChoice | None, refusal: Callable[[str], str | None]) -> None:
    """Refuse a request's cache choice where the model cannot run it (`refusal`: why, by mode)."""
    if choice is None or effective(choice) is None:
        return
    reason = refusal(choice.mode)
    if reason is not None:
        raise InvalidRequestError(
            f"cache mode {choice.mode!r} is not available for this model ({reason}); send cache mode 'none'",
            "cache.mode",
        )


def first_block_cache(params: SamplingParams) -> FirstBlockCache | None:
    """A request's empty First-Block Cache, or None when it does not cache."""
    choice = effective(params.cache)
    if choice is None or choice.mode != "first-block":
        return None
    assert choice.threshold is not None, "a request's threshold is filled in at admission (`resolved`)"
    return FirstBlockCache(choice.threshold)
