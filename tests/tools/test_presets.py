"""Every preset in configs/ loads its configuration offline, from a config-only model
directory the test writes (`tools.preset_check`: what the loading path can check without
weights), so that a typo in a preset fails here rather than on a GPU."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipelines.registry import with_embedded_defaults
from server.settings import load_settings
from tools.preset_check import (
    check_adapter,
    check_controlnets,
    check_index,
    check_ip_adapters,
    check_memory_settings,
    check_schedule,
    config_only_directory,
)
from tools.presets import ROOT, Preset, index_file, model_index, presets

# The config-only directories take their component configs from the tiny models (built on
# first use).
pytestmark = pytest.mark.slow


def load_offline(path: Path, workdir: Path) -> None:
    """Settings (flags, dtypes, quantization scheme, memory checks), the model index, the
    adapter, each component's config and the `from_pretrained` arguments."""
    settings = load_settings(path)
    config = with_embedded_defaults(settings.pipeline_config())
    settings.engine_config()
    index = model_index(config.model)
    assert index is not None, (
        f"{path.name}: no model index known for {config.model!r}; if the id is right, add its "
        f"published model_index.json as {index_file(config.model).relative_to(ROOT)} (or "
        f"`python -m tools.presets {config.model} CLASS` writes one from the tiny model of CLASS)"
    )
    directory = config_only_directory(config.model, workdir / "model")
    check_index(directory)
    adapter = check_adapter(config, index["_class_name"])
    check_controlnets(config, adapter, directory)
    check_ip_adapters(config, adapter, directory)
    check_memory_settings(config, directory)
    check_schedule(config, directory)


@pytest.mark.parametrize("preset", presets(), ids=lambda p: p.name)
def test_every_preset_loads_its_configuration_offline(preset: Preset, tmp_path: Path) -> None:
    load_offline(preset.path, tmp_path)


SDXL = (ROOT / "configs" / "sdxl.yaml").read_text()


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        ("model: stabilityai/stable-diffusion-xl-base-1.O\n", "no model index known"),
        ("pipeline_class: pipelines.registry:FluxImageToImage\n", "serves Flux"),
        ("pipeline_class: pipelines.registry:NoSuchClass\n", "has no NoSuchClass"),
        ("dtype: bfloat32\n", "dtype"),
        ("component_dtypes: {vea: float32}\n", "no component 'vea'"),
        ("quantization: bnb:nf5\n", "quantization"),
        (
            "quantization: layerwise:float8_e4m3fn\nquantize_components: unet,text_encoder_3\n",
            "text_encoder_3",
        ),
        ("scheduler: LCMSchedular\n", "no scheduler class 'LCMSchedular'"),
        (
            "scheduler: DDIMScheduler\ntimesteps: [999, 499]\ndefault_steps: 2\n",
            "DDIMScheduler takes no fixed timesteps",
        ),
        ("scheduler: LCMScheduler\ntimesteps: [249, 999]\ndefault_steps: 2\n", "strictly decreasing"),
        ("scheduler: LCMScheduler\ntimesteps: [1999, 999]\ndefault_steps: 2\n", "LCMScheduler refuses"),
        (
            "pipeline_class: pipelines.generic:GenericAdapter\ncontrolnet: {canny: c/canny}\n",
            "GenericAdapter takes no ControlNet",
        ),
        ("ip_adapter: {style: h94/IP-Adapter/sdxl_models}\n", "name a weights file"),
        ("ip_adapter: {redux: black-forest-labs/FLUX.1-Redux-dev}\n", "takes no FLUX Redux"),
    ],
)
def test_a_typo_in_a_preset_fails(tmp_path: Path, change: str, fragment: str) -> None:
    preset = tmp_path / "typo.yaml"
    preset.write_text(SDXL + change)
    with pytest.raises(Exception, match=fragment):
        load_offline(preset, tmp_path)


def test_a_model_index_that_does_not_fit_its_class_fails(tmp_path: Path) -> None:
    directory = config_only_directory("stabilityai/stable-diffusion-xl-base-1.0", tmp_path / "model")
    index = (directory / "model_index.json").read_text()
    (directory / "model_index.json").write_text(index.replace('"text_encoder_2"', '"text_encoder_3"'))
    with pytest.raises(ValueError, match="takes no component 'text_encoder_3'"):
        check_index(directory)
    (directory / "model_index.json").write_text(
        index.replace("EulerDiscreteScheduler", "EulerDiscreteSchedular")
    )
    with pytest.raises(Exception, match="EulerDiscreteSchedular"):
        check_index(directory)
