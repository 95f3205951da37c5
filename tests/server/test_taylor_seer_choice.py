"""TaylorSeer's settings at the edge: a request's `cache` object and the server's --cache
flags become the engine's `CacheChoice`, with diffusers' defaults for what they leave out."""

from __future__ import annotations

from typing import Any

import pytest

from engine.request import CacheChoice
from server.protocol import ImageGenerationRequest
from server.settings import SettingsError, load_settings


@pytest.mark.parametrize(
    ("cache", "choice"),
    [
        ({"mode": "taylorseer"}, CacheChoice("taylorseer", interval=5, warmup=3, order=1)),
        ({"mode": "taylorseer", "interval": 3, "order": 2}, CacheChoice("taylorseer", interval=3, order=2)),
        ({"mode": "taylorseer", "warmup": 0}, CacheChoice("taylorseer", warmup=0)),
        ({"mode": "first-block"}, CacheChoice("first-block")),  # the server's threshold, at admission
        ({"mode": "none"}, CacheChoice("none")),
    ],
)
def test_a_requests_cache_object_is_its_choice(cache: dict[str, Any], choice: CacheChoice) -> None:
    body = ImageGenerationRequest.model_validate({"prompt": "a", "cache": cache})
    assert body.sampling_params().cache == choice


def test_the_servers_taylor_seer_flags_are_its_default_choice() -> None:
    settings = load_settings(None, {"cache": "taylorseer", "cache_interval": "3", "cache_order": "0"})
    assert settings.pipeline_config().cache == CacheChoice("taylorseer", interval=3, warmup=3, order=0)
    # The TaylorSeer flags leave First-Block Cache as it was, and its threshold TaylorSeer.
    settings = load_settings(None, {"cache": "first-block", "cache_interval": "3"})
    assert settings.pipeline_config().cache == CacheChoice("first-block", 0.1)


@pytest.mark.parametrize("setting", ["cache_interval: 0\n", "cache_warmup: -1\n", "cache_order: 5\n"])
def test_bad_taylor_seer_settings_are_named(tmp_path: Any, setting: str) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text("cache: taylorseer\n" + setting)
    with pytest.raises(SettingsError, match=setting.split(":", maxsplit=1)[0]):
        load_settings(config)
