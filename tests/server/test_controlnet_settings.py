"""`--controlnet NAME=SOURCE`: repeatable, into the pipeline's config; refused at start with
request-level batching, where no step adds its residuals per row."""

from __future__ import annotations

import pytest

from server.cli import build_parser
from server.settings import SettingsError, load_settings


def test_the_flag_repeats_and_reaches_the_pipeline_config() -> None:
    args = build_parser().parse_args(
        [
            "serve",
            "tiny-sd",
            "--controlnet",
            "edges=tiny-sd-controlnet",
            "--controlnet",
            "depth=/models/depth",
        ]
    )
    settings = load_settings(None, {"model": "tiny-sd", "controlnet": args.controlnet}, environ={})
    assert settings.pipeline_config().controlnets == (
        ("edges", "tiny-sd-controlnet"),
        ("depth", "/models/depth"),
    )


def test_request_level_batching_refuses_the_flag_in_one_line() -> None:
    with pytest.raises(SettingsError, match="--controlnet needs --batching step"):
        load_settings(None, {"controlnet": ["edges=tiny-sd-controlnet"], "batching": "request"}, environ={})
