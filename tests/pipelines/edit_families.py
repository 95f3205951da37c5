"""The tiny models served with image-to-image and inpainting, by name: what the edit tests
(`test_edit_stepping.py`, `test_image_to_image.py`) load. A `pipeline_class` calls a
text-to-image model through the family's img2img or inpainting pipeline; without one the
model's own index names the pipeline (inpainting checkpoints, SDXL's refiner)."""

from __future__ import annotations

from pipelines.base import PipelineConfig
from tests.threads import THREADS


def _served(model: str, pipeline_class: str | None = None) -> PipelineConfig:
    return PipelineConfig(model=model, pipeline_class=pipeline_class, num_threads=THREADS)


IMAGE_TO_IMAGE = {
    "sd-img2img": _served("tiny-sd", "pipelines.registry:StableDiffusionImageToImage"),
    "sdxl-img2img": _served("tiny-sdxl", "pipelines.registry:StableDiffusionXLImageToImage"),
    "sdxl-refiner": _served("tiny-sdxl-refiner"),
    "flux-img2img": _served("tiny-flux", "pipelines.registry:FluxImageToImage"),
    "qwen-image-img2img": _served("tiny-qwen-image", "pipelines.registry:QwenImageImageToImage"),
    "z-image-img2img": _served("tiny-z-image", "pipelines.registry:ZImageImageToImage"),
    "chroma-img2img": _served("tiny-chroma", "pipelines.registry:ChromaImageToImage"),
}
INPAINTING = {
    "sd-inpaint": _served("tiny-sd-inpaint"),
    "sd-inpaint-4ch": _served("tiny-sd", "pipelines.registry:StableDiffusionInpaint"),
    "sdxl-inpaint": _served("tiny-sdxl-inpaint"),
    "sdxl-inpaint-4ch": _served("tiny-sdxl", "pipelines.registry:StableDiffusionXLInpaint"),
    "flux-inpaint": _served("tiny-flux", "pipelines.registry:FluxInpaint"),
    "qwen-image-inpaint": _served("tiny-qwen-image", "pipelines.registry:QwenImageInpaint"),
    "z-image-inpaint": _served("tiny-z-image", "pipelines.registry:ZImageInpaint"),
    "chroma-inpaint": _served("tiny-chroma", "pipelines.registry:ChromaInpaint"),
}
