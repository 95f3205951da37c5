"""TaylorSeer through a real `diffbatch serve tiny-flux --cache taylorseer` (step mode) with
the official client: the server's settings for requests that choose none, a request's own
settings, one with First-Block Cache and one that turns caching off, sent together; each image
is the one its request makes alone; the skipped blocks show in `/metrics`; a bad setting is a
400 naming its field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest

from bench.launch import start_server, stop_server
from engine.request import CacheChoice
from tests.e2e.test_step_cache import assert_each_matches_alone, generate, served_together

pytestmark = pytest.mark.slow

SERVER_CACHE = CacheChoice("taylorseer", interval=2, warmup=1, order=1)
SERVER_ARGS = ("--cache", "taylorseer", "--cache-interval", "2", "--cache-warmup", "1")  # SERVER_CACHE
# (extra body, the cache it runs with)
BODIES: list[tuple[dict[str, Any], CacheChoice]] = [
    ({"seed": 1}, SERVER_CACHE),
    (
        {"seed": 2, "cache": {"mode": "taylorseer", "interval": 3, "order": 2}},
        CacheChoice("taylorseer", interval=3, order=2),
    ),
    ({"seed": 3, "cache": {"mode": "first-block", "threshold": 0.45}}, CacheChoice("first-block", 0.45)),
    ({"seed": 4, "cache": {"mode": "none"}}, CacheChoice("none")),
]


def test_taylor_seer_requests_served_together_each_match_alone(tmp_path: Path) -> None:
    server = start_server(
        tmp_path,
        "tiny-flux",
        *SERVER_ARGS,
        config=None,
    )
    try:
        with openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0) as client:
            served = served_together(server, client, BODIES)
            with pytest.raises(openai.BadRequestError) as refused:
                generate(client, {"cache": {"mode": "taylorseer", "threshold": 0.1}})
            assert refused.value.body["param"] == "cache.threshold"  # type: ignore[index]
        assert server.metric("diffbatch_cache_blocks_skipped_total") > 0
    finally:
        stop_server(server)

    assert_each_matches_alone(BODIES, served)


def test_a_new_family_serves_taylor_seer(tmp_path: Path) -> None:
    """Z-Image (a new family; TaylorSeer needs nothing of its denoiser): the server's
    settings, a request's own and one without a cache, sent together, each its own image
    alone; the skipped blocks in `/metrics`."""
    bodies: list[tuple[dict[str, Any], CacheChoice]] = [
        ({"seed": 1}, SERVER_CACHE),
        ({"seed": 2, "cache": {"mode": "taylorseer", "interval": 3, "order": 2}}, BODIES[1][1]),
        ({"seed": 4, "cache": {"mode": "none"}}, CacheChoice("none")),
    ]
    server = start_server(
        tmp_path,
        "tiny-z-image",
        *SERVER_ARGS,
        config=None,
    )
    try:
        with openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0) as client:
            served = served_together(server, client, bodies)
        assert server.metric("diffbatch_cache_blocks_skipped_total") > 0
    finally:
        stop_server(server)

    assert_each_matches_alone(bodies, served, "tiny-z-image")
