"""The presets for the real weights of issue 24's image families name adapters that serve
them step-level: each preset's model (whose model index names the diffusers class given
here) or its `pipeline_class` resolves to the family and task it is written for. Nothing is
loaded: no weights, no network."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipelines.adapter import DiffusersAdapter
from pipelines.families.base import Family
from pipelines.families.chroma import Chroma
from pipelines.families.ovis_image import OvisImage
from pipelines.families.z_image import ZImage
from pipelines.registry import adapter_for, import_pipeline_class
from server.settings import load_settings

CONFIGS = Path(__file__).resolve().parents[2] / "configs"

# (preset, the class its model's index names, family, task)
PRESETS: list[tuple[str, str, type[Family], str]] = [
    ("z-image-turbo", "ZImagePipeline", ZImage, "text-to-image"),
    ("z-image", "ZImagePipeline", ZImage, "text-to-image"),
    ("z-image-turbo-img2img", "ZImagePipeline", ZImage, "image-to-image"),
    ("chroma", "ChromaPipeline", Chroma, "text-to-image"),
    ("chroma-img2img", "ChromaPipeline", Chroma, "image-to-image"),
    ("chroma-inpaint", "ChromaPipeline", Chroma, "inpainting"),
    ("ovis-image", "OvisImagePipeline", OvisImage, "text-to-image"),
]


@pytest.mark.parametrize(("preset", "class_name", "family", "task"), PRESETS, ids=[p[0] for p in PRESETS])
def test_the_preset_picks_an_adapter_that_steps(
    preset: str, class_name: str, family: type[Family], task: str
) -> None:
    config = load_settings(CONFIGS / f"{preset}.yaml").pipeline_config()
    adapter = (
        import_pipeline_class(config.pipeline_class) if config.pipeline_class else adapter_for(class_name)
    )
    assert issubclass(adapter, DiffusersAdapter) and adapter.family_class is family
    assert adapter.use.task.name == task and adapter.use.stepped
    assert config.device == "cuda" and config.dtype == "bfloat16"
