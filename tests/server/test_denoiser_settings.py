"""Denoiser settings (`--compile`, `--attention-backend`): each a flag and a YAML key, and
what this host cannot run is refused at start with a message naming the flag."""

from __future__ import annotations

import re
import typing
from pathlib import Path

import pytest

from pipelines.base import PipelineConfig
from pipelines.denoiser import options
from pipelines.denoiser.options import ATTENTION_BACKENDS, AttentionBackendChoice, DenoiserConfig
from server import cli
from server.cli import build_parser
from server.settings import SettingsError, load_settings


def config_from_flags(*flags: str) -> DenoiserConfig:
    args = build_parser().parse_args(["serve", "tiny-sd", *flags])
    overrides = {k: v for k, v in vars(args).items() if k not in ("command", "config")}
    return load_settings(None, overrides, {}).pipeline_config().denoiser


def test_flags_and_yaml_give_the_same_denoiser_config(tmp_path: Path) -> None:
    preset = tmp_path / "compiled.yaml"
    preset.write_text("compile: blocks\nattention_backend: math\ncompile_sizes: [48x48, 32x64]\n")
    flags = config_from_flags(
        "--compile", "blocks", "--attention-backend", "math", "--compile-sizes", "48x48", "32x64"
    )
    assert load_settings(preset).pipeline_config().denoiser == flags
    assert (flags.compile, flags.attention_backend) == ("blocks", "math")
    assert flags.warmup_sizes == ((48, 48), (32, 64))
    assert PipelineConfig().denoiser == DenoiserConfig(compile="off", attention_backend="native")


def test_the_flag_choices_are_the_backends_known() -> None:
    assert set(typing.get_args(AttentionBackendChoice)) == set(ATTENTION_BACKENDS)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--compile", "fast"], r"argument --compile: invalid choice: 'fast'"),
        (["--attention-backend", "flashy"], r"argument --attention-backend: invalid choice: 'flashy'"),
    ],
)
def test_an_unknown_value_is_a_start_error_naming_the_flag(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["serve", "tiny-sd", *flags])
    assert exited.value.code == 2
    assert re.search(message, capsys.readouterr().err)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"compile": "fast"}, "compile"),
        ({"compile_sizes": ["48"]}, "--compile-sizes: write each size as WxH"),
        ({"attention_backend": "flash"}, "--attention-backend: flash runs on CUDA only; --device is cpu"),
        ({"attention_backend": "cudnn"}, "--attention-backend: cudnn runs on CUDA only"),
        (
            {"compile": "blocks", "lora_modules": ["a=tiny-lora-1"]},
            "--compile: cannot go with --lora-modules",
        ),
    ],
)
def test_what_cannot_be_served_here_is_refused_naming_the_flag(
    overrides: dict[str, object], message: str
) -> None:
    with pytest.raises(SettingsError, match=message):
        load_settings(None, overrides, {})


def test_a_backend_package_not_installed_is_refused_before_loading(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """On a CUDA device the settings pass; the serving process then refuses at start, before
    the app is built, naming the flag and the package (none of them is installed here)."""
    monkeypatch.setattr(options, "installed", lambda package: False)
    on_cuda = load_settings(None, {"attention_backend": "sage", "device": "cuda"}, {})
    assert on_cuda.attention_backend == "sage"
    assert cli.main(["serve", "tiny-sd", "--device", "cuda", "--attention-backend", "sage"]) == 2
    assert "--attention-backend: sage needs the sageattention package" in capsys.readouterr().err
