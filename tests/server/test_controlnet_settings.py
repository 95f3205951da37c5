"""`--controlnet NAME=SOURCE`: repeatable, into the pipeline's config, with either batching
mode (request level runs a controlled batch through the family's stages)."""

from __future__ import annotations

from server.cli import build_parser
from server.settings import load_settings


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


def test_request_level_batching_takes_the_flag() -> None:
    settings = load_settings(
        None, {"controlnet": ["edges=tiny-sd-controlnet"], "batching": "request"}, environ={}
    )
    assert settings.pipeline_config().controlnets == (("edges", "tiny-sd-controlnet"),)
