"""Memory settings: each a flag and a YAML key, and what this host cannot serve is refused
at start with a message naming the flag, before any weight loads."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pipelines.base import PipelineConfig
from pipelines.memory import options
from pipelines.memory.loading import check_memory
from pipelines.memory.options import MemoryConfig, MemorySettingError, Quantization
from server import cli
from server.cli import build_parser
from server.settings import SettingsError, load_settings


def settings_from_flags(*flags: str) -> MemoryConfig:
    args = build_parser().parse_args(["serve", "tiny-sd", *flags])
    overrides = {k: v for k, v in vars(args).items() if k not in ("command", "config")}
    return load_settings(None, overrides, {}).pipeline_config().memory


def test_flags_and_yaml_give_the_same_memory_config(tmp_path: Path) -> None:
    flags = settings_from_flags(
        "--component-dtypes",
        "vae=float32",
        "--component-dtypes",
        "text_encoder=bfloat16",
        "--offload",
        "group",
        "--offload-to-disk",
        str(tmp_path),
        "--quantization",
        "layerwise:float8_e4m3fn",
        "--decode-budget",
        "2x512x512",
        "--vae-tiling",
        "off",
    )
    preset = tmp_path / "memory.yaml"
    preset.write_text(
        "component_dtypes: {vae: float32, text_encoder: bfloat16}\n"
        f"offload: group\noffload_to_disk: {tmp_path}\n"
        "quantization: layerwise:float8_e4m3fn\ndecode_budget: 524288\nvae_tiling: 'off'\n"
    )
    assert load_settings(preset).pipeline_config().memory == flags
    assert flags.dtypes == {"vae": "float32", "text_encoder": "bfloat16"}
    assert flags.quantization == Quantization("layerwise", "float8_e4m3fn")
    assert flags.decode_budget == 2 * 512 * 512


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"component_dtypes": ["vae=float64"]}, "--component-dtypes: vae=float64: the dtype must be one of"),
        ({"component_dtypes": ["vae"]}, "--component-dtypes: write each as COMPONENT=DTYPE"),
        (
            {"quantization": "int8"},
            "--quantization: unknown quantization 'int8'; choose one of torchao:int8wo",
        ),
        ({"quantization": "torchao:int4"}, "--quantization: unknown torchao scheme 'int4'"),
        ({"offload": "model"}, "--offload: model offload moves weights between the CPU and an accelerator"),
        ({"offload": "sequential"}, "--offload: sequential offload moves weights"),
        ({"offload": "group"}, "--offload: group offload on the CPU .* add --offload-to-disk PATH"),
        ({"offload_to_disk": "/tmp/x"}, "--offload-to-disk: goes with --offload group"),
        ({"quantization": "bitsandbytes:nf4"}, "--quantization: bitsandbytes:nf4 runs on CUDA only"),
        ({"quantization": "torchao:float8wo"}, "--quantization: torchao:float8wo runs on CUDA only"),
        ({"decode_budget": 0}, "decode_budget"),
    ],
)
def test_what_cannot_be_served_here_is_refused_naming_the_flag(
    overrides: dict[str, object], message: str
) -> None:
    with pytest.raises(SettingsError, match=message):
        load_settings(None, overrides, {})


def test_a_backend_not_installed_is_refused_where_the_model_loads_naming_the_flag_and_the_extra(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The serving process refuses at start (`diffbatch serve`, before the app is built);
    the settings alone do not: a Ray gateway builds them and never loads the model."""
    monkeypatch.setattr(options, "installed", lambda package: False)
    for flags, message in [
        (
            ["--quantization", "torchao:int8wo"],
            r"--quantization: torchao:int8wo needs the torchao package.*diffbatch\[torchao\]",
        ),
        (
            ["--quantization", "bitsandbytes:int8", "--device", "cuda"],
            r"--quantization: bitsandbytes:int8 needs the bitsandbytes package",
        ),
        (
            ["--transformer-file", "flux-q8_0.gguf"],
            r"--transformer-file: reading flux-q8_0.gguf needs the gguf package",
        ),
    ]:
        assert cli.main(["serve", "tiny-sd", *flags]) == 2
        assert re.search(message, capsys.readouterr().err), flags
    with pytest.raises(MemorySettingError, match=r"--quantization: torchao:int8wo needs the torchao package"):
        check_memory(
            PipelineConfig(
                model="tiny-sd", memory=MemoryConfig(quantization=Quantization("torchao", "int8wo"))
            )
        )
    # Layerwise casting is diffusers' own: no package to miss.
    assert load_settings(None, {"quantization": "layerwise:float8_e4m3fn"}, {}).quantization


def test_on_a_cuda_device_the_accelerator_schemes_pass_the_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(options, "installed", lambda package: True)
    for offload in ("model", "sequential", "group"):
        assert load_settings(None, {"offload": offload, "device": "cuda"}, {}).offload == offload
    settings = load_settings(
        None, {"quantization": "bitsandbytes:nf4", "device": "cuda:0,cuda:1", "data_parallel_size": 2}, {}
    )
    assert settings.pipeline_config().memory.quantization == Quantization("bitsandbytes", "nf4")


@pytest.mark.parametrize("offload", ["model", "sequential"])
@pytest.mark.parametrize("overlap", ["on", "auto"])
def test_model_or_sequential_offload_refuses_decoding_beside_the_steps(offload: str, overlap: str) -> None:
    """accelerate's hooks move whole components (or layers) between devices on each call: a
    decode on its own thread would offload the denoiser in the middle of a step, and a
    step's hook the VAE in the middle of the decode."""
    with pytest.raises(SettingsError, match=rf"--decode-overlap {overlap}.*--offload {offload}"):
        load_settings(None, {"offload": offload, "device": "cuda", "decode_overlap": overlap}, {})
    assert load_settings(None, {"offload": offload, "device": "cuda"}, {}).decode_overlap == "off"
    group = {"offload": "group", "device": "cuda", "decode_overlap": overlap}
    assert load_settings(None, group, {}).decode_overlap == overlap  # each component's own blocks
