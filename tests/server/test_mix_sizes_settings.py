"""`--mix-sizes on|pad|off`: a flag and a YAML key that reach the pipeline's config
(`PipelineConfig.mix_sizes` and `pack_sizes`, read by `Family.mixes_sizes_for` and
`Family.packs_sizes_for`)."""

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


def test_pad_mixes_sizes_on_one_grid_without_packing() -> None:
    args = build_parser().parse_args(["serve", "tiny-flux", "--mix-sizes", "pad"])
    overrides = {k: v for k, v in vars(args).items() if k not in ("command", "config")}
    for config in (
        load_settings(None, overrides, {}).pipeline_config(),
        load_settings(None, {"mix_sizes": "pad"}).pipeline_config(),
    ):
        assert config.mix_sizes is True and config.pack_sizes is False
    default = load_settings(None, {}).pipeline_config()
    assert default.mix_sizes is True and default.pack_sizes is True
