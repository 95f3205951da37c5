"""Which adapter serves a model: keyed by the diffusers class in `model_index.json`."""

from __future__ import annotations

import importlib
import json
import logging
from dataclasses import replace
from pathlib import Path

from pipelines.base import Pipeline, PipelineConfig
from pipelines.flux import FluxTextToImage
from pipelines.image_edit import QwenImageEdit, QwenImageEditPlus
from pipelines.image_to_image import StableDiffusionImageToImage, StableDiffusionXLImageToImage
from pipelines.inpainting import StableDiffusionInpaint, StableDiffusionXLInpaint
from pipelines.loading import resolve_model_path
from pipelines.ltx import LTX2TextToVideo, LTXTextToVideo
from pipelines.qwen_image import QwenImageTextToImage
from pipelines.sd3 import StableDiffusion3TextToImage
from pipelines.sdxl import StableDiffusionXLTextToImage
from pipelines.stable_diffusion import StableDiffusionTextToImage
from pipelines.tiny import TINY_MODELS
from pipelines.trained.shipped import SHIPPED_MODELS
from pipelines.wan import WanImageToVideo, WanTextToVideo

logger = logging.getLogger(__name__)

ADAPTERS: dict[str, type[Pipeline]] = {
    "StableDiffusionPipeline": StableDiffusionTextToImage,
    "StableDiffusionInpaintPipeline": StableDiffusionInpaint,
    "StableDiffusionImg2ImgPipeline": StableDiffusionImageToImage,
    "StableDiffusionXLPipeline": StableDiffusionXLTextToImage,
    "StableDiffusionXLImg2ImgPipeline": StableDiffusionXLImageToImage,  # SDXL's refiner
    "StableDiffusionXLInpaintPipeline": StableDiffusionXLInpaint,
    "StableDiffusion3Pipeline": StableDiffusion3TextToImage,
    "FluxPipeline": FluxTextToImage,
    "QwenImagePipeline": QwenImageTextToImage,
    "WanPipeline": WanTextToVideo,
    "LTXPipeline": LTXTextToVideo,
    "LTX2Pipeline": LTX2TextToVideo,
    "WanImageToVideoPipeline": WanImageToVideo,
    "QwenImageEditPipeline": QwenImageEdit,
    "QwenImageEditPlusPipeline": QwenImageEditPlus,
}


def diffusers_class_name(model_path: str) -> str:
    """The `_class_name` of a local diffusers directory or hub id's `model_index.json`."""
    index = Path(model_path) / "model_index.json"
    if index.is_file():
        config = json.loads(index.read_text())
    elif Path(model_path).exists():
        raise ValueError(f"{model_path} has no model_index.json: it is not a diffusers pipeline directory")
    else:
        from diffusers import DiffusionPipeline  # a hub id: fetch only its model_index.json

        config = DiffusionPipeline.load_config(model_path)
    name = config.get("_class_name")
    if not isinstance(name, str):
        raise ValueError(f"model_index.json of {model_path} names no _class_name")
    return name


def adapter_for(class_name: str) -> type[Pipeline]:
    try:
        return ADAPTERS[class_name]
    except KeyError:
        known = ", ".join(sorted(ADAPTERS))
        raise ValueError(
            f"no adapter serves {class_name}; supported: {known}. A custom adapter can be "
            "given as pipeline_class='module:Class' (a pipelines.base.Pipeline subclass)"
        ) from None


def import_pipeline_class(spec: str) -> type[Pipeline]:
    """Import `module:Class` and check that it is a `Pipeline` subclass."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"pipeline_class must look like 'module:Class', got {spec!r}")
    obj = getattr(importlib.import_module(module_name), attr, None)
    if obj is None:
        raise ValueError(f"module {module_name} has no {attr}")
    if not (isinstance(obj, type) and issubclass(obj, Pipeline)):
        raise ValueError(f"{spec} is not a subclass of pipelines.base.Pipeline")
    return obj


def with_embedded_defaults(config: PipelineConfig) -> PipelineConfig:
    """An embedded model (tiny or shipped trained) brings its own serving defaults, unless
    the config sets them."""
    embedded = TINY_MODELS.get(config.model) or SHIPPED_MODELS.get(config.model)
    if embedded is None:
        return config
    guidance = config.default_guidance_scale
    return replace(
        config,
        default_size=config.default_size or embedded.default_size,
        default_steps=config.default_steps or embedded.default_steps,
        default_guidance_scale=embedded.default_guidance_scale if guidance is None else guidance,
    )


def load_pipeline(config: PipelineConfig) -> Pipeline:
    config = with_embedded_defaults(config)
    if config.pipeline_class:
        cls = import_pipeline_class(config.pipeline_class)
    else:
        cls = adapter_for(diffusers_class_name(resolve_model_path(config.model)))
    logger.info("loading %s with %s on %s", config.model, cls.__qualname__, config.device)
    return cls.load(config)
