"""The embedded tiny models build deterministically offline and load like any model."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from pipelines import registry
from pipelines.adapter import DiffusersAdapter
from pipelines.base import PipelineConfig
from pipelines.loading import diffusers_class_name
from pipelines.registry import adapter_for, import_pipeline_class, load_pipeline
from pipelines.tiny import TINY_MODELS, tiny_model_dir

pytestmark = pytest.mark.slow


def tree_digest(directory: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(directory)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


TINY_CLASSES = {
    "tiny-sd": "StableDiffusionPipeline",
    "tiny-sd-inpaint": "StableDiffusionInpaintPipeline",
    "tiny-sdxl": "StableDiffusionXLPipeline",
    "tiny-sdxl-inpaint": "StableDiffusionXLInpaintPipeline",
    "tiny-sdxl-refiner": "StableDiffusionXLImg2ImgPipeline",
    "tiny-sd3": "StableDiffusion3Pipeline",
    "tiny-flux": "FluxPipeline",
    "tiny-qwen-image": "QwenImagePipeline",
    "tiny-wan": "WanPipeline",
    "tiny-ltx": "LTXPipeline",
    "tiny-ltx2": "LTX2Pipeline",
    "tiny-wan-i2v": "WanImageToVideoPipeline",
    "tiny-qwen-image-edit": "QwenImageEditPipeline",
    "tiny-qwen-image-edit-plus": "QwenImageEditPlusPipeline",
    "tiny-flux2": "Flux2Pipeline",
    "tiny-flux2-klein": "Flux2KleinPipeline",
    "tiny-z-image": "ZImagePipeline",
    "tiny-flux-kontext": "FluxKontextPipeline",
    "tiny-flux-fill": "FluxFillPipeline",
    "tiny-chroma": "ChromaPipeline",
    "tiny-qwen-image-edit-2511": "QwenImageEditPlusPipeline",
    "tiny-qwen-image-21": "QwenImage21Pipeline",
    "tiny-ovis-image": "OvisImagePipeline",
    "tiny-pixart-sigma": "PixArtSigmaPipeline",
    "tiny-sana": "SanaPipeline",
    "tiny-wan22": "WanPipeline",
    "tiny-wan22-i2v": "WanImageToVideoPipeline",
    "tiny-wan22-ti2v": "WanPipeline",
    "tiny-hunyuan-video15": "HunyuanVideo15Pipeline",
    "tiny-hunyuan-video15-i2v": "HunyuanVideo15ImageToVideoPipeline",
    "tiny-wan-vace": "WanVACEPipeline",
}


def test_every_tiny_model_is_listed() -> None:
    assert set(TINY_MODELS) == set(TINY_CLASSES)


@pytest.mark.parametrize(("name", "class_name"), TINY_CLASSES.items())
def test_tiny_models_build_byte_identical_files(tmp_path: Path, name: str, class_name: str) -> None:
    first = tiny_model_dir(name, tmp_path / "a")
    second = tiny_model_dir(name, tmp_path / "b")
    assert tree_digest(first) == tree_digest(second)
    index = json.loads((first / "model_index.json").read_text())
    assert index["_class_name"] == class_name
    if TINY_MODELS[name].served:
        assert adapter_for(class_name) is not None
    else:  # Built ahead of its adapter: the day one serves it, `served` must say so.
        with pytest.raises(ValueError, match=f"no adapter serves {class_name}"):
            adapter_for(class_name)
    # A second call reuses the cache instead of rebuilding.
    assert tiny_model_dir(name, tmp_path / "a") == first


def test_registry_picks_the_adapter_from_model_index(tmp_path: Path) -> None:
    directory = tiny_model_dir("tiny-sd", tmp_path)
    assert adapter_for(diffusers_class_name(str(directory))) is registry.StableDiffusionTextToImage
    # A local directory loads through the same path as a built-in name.
    pipeline = load_pipeline(PipelineConfig(model=str(directory)))
    assert isinstance(pipeline, DiffusersAdapter)
    assert (pipeline.default_width, pipeline.default_height) == (64, 64)


def test_a_use_no_model_index_names_loads_by_its_composed_name() -> None:
    assert import_pipeline_class("pipelines.registry:QwenImageInpaint") is adapter_for(
        "QwenImageInpaintPipeline"
    )


def test_unknown_models_and_classes_are_explained(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no adapter serves FancyPipeline"):
        adapter_for("FancyPipeline")
    with pytest.raises(ValueError, match="not a diffusers pipeline directory"):
        diffusers_class_name(str(tmp_path))
    with pytest.raises(ValueError, match="module:Class"):
        import_pipeline_class("no_colon")
    with pytest.raises(ValueError, match="not a subclass"):
        import_pipeline_class("pathlib:Path")
    with pytest.raises(ValueError, match=r"module pipelines\.registry has no Nothing"):
        import_pipeline_class("pipelines.registry:Nothing")
    with pytest.raises(ValueError, match="unknown tiny model"):
        tiny_model_dir("tiny-nothing", tmp_path)
