"""Which cache a request runs with (issue 27): a request's own `cache` without a threshold
takes the server's `--cache-threshold`, and OpenAI's `quality` picks a cache level as well as
steps where the server caches (low: at least a modest threshold, high: every block runs)."""

from __future__ import annotations

import pytest

from engine.request import CacheChoice, GenerationRequest, Quality
from pipelines.base import Pipeline, PipelineConfig
from pipelines.cache.choice import LOW_QUALITY_THRESHOLD, resolved
from pipelines.registry import load_pipeline
from server.protocol import ImageGenerationRequest

pytestmark = pytest.mark.slow

_LOADED: dict[CacheChoice, Pipeline] = {}


def admitted(served: CacheChoice, body: dict[str, object]) -> CacheChoice | None:
    """The cache of a request with this JSON body, as a server with `served` admits it."""
    if served not in _LOADED:
        _LOADED[served] = load_pipeline(PipelineConfig(model="shapes-dit", num_threads=1, cache=served))
    pipeline = _LOADED[served]
    wire = ImageGenerationRequest.model_validate({"prompt": "a red circle", **body})
    request = GenerationRequest.create(wire.prompt, wire.sampling_params(quality=wire.quality_tier()))
    return pipeline.resolve(request).cache


def test_a_taylor_seer_server_keeps_its_threshold_for_first_block_requests() -> None:
    # --cache taylorseer --cache-threshold 0.3: the default choice has no threshold of its own.
    served = CacheChoice("taylorseer", interval=3)
    asked = CacheChoice("first-block")
    assert resolved(asked, served, None, threshold=0.3) == CacheChoice("first-block", 0.3)
    assert resolved(None, served, "low", threshold=0.3) == served  # its own schedule, no threshold
    assert resolved(None, served, "high", threshold=0.3) == CacheChoice("none")


def test_a_mode_without_a_threshold_takes_the_servers_threshold() -> None:
    for served in (CacheChoice("none", 0.3), CacheChoice("first-block", 0.3)):
        assert admitted(served, {"cache": {"mode": "first-block"}}) == CacheChoice("first-block", 0.3)
        assert admitted(served, {"cache": {"mode": "first-block", "threshold": 0.2}}) == CacheChoice(
            "first-block", 0.2
        )


@pytest.mark.parametrize(
    ("served_threshold", "quality", "expected"),
    [
        (0.05, "low", CacheChoice("first-block", LOW_QUALITY_THRESHOLD)),  # at least modest
        (0.3, "low", CacheChoice("first-block", 0.3)),  # never less than medium
        (0.05, "medium", CacheChoice("first-block", 0.05)),
        (0.05, "auto", CacheChoice("first-block", 0.05)),
        (0.05, "high", CacheChoice("none")),
        (0.05, "hd", CacheChoice("none")),
    ],
)
def test_quality_picks_a_cache_level_where_the_server_caches(
    served_threshold: float, quality: Quality, expected: CacheChoice
) -> None:
    served = CacheChoice("first-block", served_threshold)
    assert admitted(served, {"quality": quality}) == expected
    # A request's own cache wins, and steps named explicitly leave quality out of it.
    own = admitted(served, {"quality": quality, "cache": {"mode": "none"}})
    assert own == CacheChoice("none")
    assert admitted(served, {"quality": quality, "num_inference_steps": 4}) == served


def test_quality_never_turns_the_cache_on_where_the_server_does_not_cache() -> None:
    served = CacheChoice("none", 0.1)
    for quality in ("low", "medium", "high"):
        assert admitted(served, {"quality": quality}) == served
