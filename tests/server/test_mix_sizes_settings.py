"""`--mix-sizes on|off`: a flag and a YAML key that reach the pipeline's config
(`PipelineConfig.mix_sizes`, read by `Family.mixes_sizes_for`)."""

from __future__ import annotations

from server.cli import build_parser
from server.settings import load_settings


def mix_sizes_from_flags(*flags: str) -> bool:
    args = build_parser().parse_args(["serve", "tiny-flux", *flags])
    overrides = {k: v for k, v in vars(args).items() if k not in ("command", "config")}
    return load_settings(None, overrides, {}).pipeline_config().mix_sizes


def test_sizes_mix_unless_turned_off() -> None:
    assert mix_sizes_from_flags() is True
    assert mix_sizes_from_flags("--mix-sizes", "off") is False
    assert load_settings(None, {"mix_sizes": "off"}).pipeline_config().mix_sizes is False
