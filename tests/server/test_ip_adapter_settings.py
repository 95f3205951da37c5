"""`--ip-adapter NAME=SOURCE`: repeatable, into the pipeline's config; refused at start with
request-level batching, where no step adds a reference image per row; a name may not repeat
a model, adapter or ControlNet name."""

from __future__ import annotations

import pytest

from server.cli import build_parser
from server.settings import SettingsError, load_settings


def test_the_flag_repeats_and_reaches_the_pipeline_config() -> None:
    args = build_parser().parse_args(
        [
            "serve",
            "tiny-sd",
            "--ip-adapter",
            "style=tiny-sd-ip-adapter",
            "--ip-adapter",
            "plus=h94/IP-Adapter/models/ip-adapter-plus_sd15.safetensors",
        ]
    )
    settings = load_settings(None, {"model": "tiny-sd", "ip_adapter": args.ip_adapter}, environ={})
    assert settings.pipeline_config().ip_adapters == (
        ("style", "tiny-sd-ip-adapter"),
        ("plus", "h94/IP-Adapter/models/ip-adapter-plus_sd15.safetensors"),
    )


def test_request_level_batching_refuses_the_flag_in_one_line() -> None:
    with pytest.raises(SettingsError, match="--ip-adapter needs --batching step"):
        load_settings(None, {"ip_adapter": ["style=tiny-sd-ip-adapter"], "batching": "request"}, environ={})


def test_a_name_may_not_be_both_a_controlnet_and_an_ip_adapter() -> None:
    with pytest.raises(SettingsError, match="edges names more than one"):
        load_settings(
            None,
            {"controlnet": ["edges=tiny-sd-controlnet"], "ip_adapter": ["edges=tiny-sd-ip-adapter"]},
            environ={},
        )
