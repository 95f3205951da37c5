"""The names adapters had before the family/task layout, so old configs, commands and
imports keep working: the `--pipeline-class` paths (`ALIASES`, which the registry consults
before importing anything) and the Python names tests, benches and users' own subclasses
import.

Each old name of a (family, diffusers class) pair is a real one-line class composed from
them: it pickles (a `spec()` crosses processes), it is a valid base for a user's subclass,
and since it is declared before the registry composes anything, it is the class the
registry hands out for that pair (log lines keep their names).

Families not yet ported to `pipelines.families` still run on their old classes, which the
old names here point at until they are.
"""

from __future__ import annotations

from abc import ABCMeta
from typing import Any, ClassVar

from pipelines.adapter import DiffusersAdapter
from pipelines.base import Pipeline
from pipelines.families.base import GenericVideo
from pipelines.families.flux import Flux
from pipelines.families.ltx import LTX
from pipelines.families.ltx2 import LTX2
from pipelines.families.qwen_image import QwenImage
from pipelines.families.sd3 import StableDiffusion3
from pipelines.families.sdxl import StableDiffusionXL
from pipelines.families.stable_diffusion import StableDiffusion
from pipelines.families.wan import Wan
from pipelines.stepping.preview import MIN_IMAGES, LinearPreview
from pipelines.tasks.base import Task
from pipelines.tasks.inpainting import INPAINTING
from pipelines.tasks.video import TEXT_TO_VIDEO

__all__ = [
    "ALIASES",
    "MIN_IMAGES",
    "DiffusersTextToImage",
    "DiffusersTextToVideo",
    "FluxImageToImage",
    "FluxInpaint",
    "FluxTextToImage",
    "Inpainting",
    "LTX2TextToVideo",
    "LTXTextToVideo",
    "LinearPreview",
    "QwenImageEdit",
    "QwenImageEditPlus",
    "QwenImageImageToImage",
    "QwenImageInpaint",
    "QwenImageTextToImage",
    "StableDiffusion3TextToImage",
    "StableDiffusionImageToImage",
    "StableDiffusionInpaint",
    "StableDiffusionTextToImage",
    "StableDiffusionXLImageToImage",
    "StableDiffusionXLInpaint",
    "StableDiffusionXLTextToImage",
    "SteppedStages",
    "WanImageToVideo",
    "WanTextToVideo",
]

# The generic adapter (request level, diffusers' usual defaults) and the step stages, which
# are the same class now; tests name them in annotations and `isinstance` checks.
DiffusersTextToImage = DiffusersAdapter
SteppedStages = DiffusersAdapter


class StableDiffusionTextToImage(DiffusersAdapter, family=StableDiffusion, serves="StableDiffusionPipeline"):
    """Stable Diffusion 1.x/2.x text-to-image (the old `pipelines.stable_diffusion` class)."""


class StableDiffusionImageToImage(
    DiffusersAdapter, family=StableDiffusion, serves="StableDiffusionImg2ImgPipeline"
):
    """Stable Diffusion image-to-image (the old `pipelines.image_to_image` class)."""


class StableDiffusionInpaint(
    DiffusersAdapter, family=StableDiffusion, serves="StableDiffusionInpaintPipeline"
):
    """Stable Diffusion inpainting, 9- or 4-channel (the old `pipelines.inpainting` class)."""


class StableDiffusionXLTextToImage(
    DiffusersAdapter, family=StableDiffusionXL, serves="StableDiffusionXLPipeline"
):
    """SDXL text-to-image (the old `pipelines.sdxl` class)."""


class StableDiffusionXLImageToImage(
    DiffusersAdapter, family=StableDiffusionXL, serves="StableDiffusionXLImg2ImgPipeline"
):
    """SDXL image-to-image and its refiner (the old `pipelines.image_to_image` class)."""


class StableDiffusionXLInpaint(
    DiffusersAdapter, family=StableDiffusionXL, serves="StableDiffusionXLInpaintPipeline"
):
    """SDXL inpainting (the old `pipelines.inpainting` class)."""


class FluxTextToImage(DiffusersAdapter, family=Flux, serves="FluxPipeline"):
    """FLUX.1 text-to-image (the old `pipelines.flux` class)."""


class FluxImageToImage(DiffusersAdapter, family=Flux, serves="FluxImg2ImgPipeline"):
    """FLUX.1 image-to-image (the old `pipelines.image_to_image` class)."""


class FluxInpaint(DiffusersAdapter, family=Flux, serves="FluxInpaintPipeline"):
    """FLUX.1 inpainting (the old `pipelines.inpainting` class)."""


class QwenImageTextToImage(DiffusersAdapter, family=QwenImage, serves="QwenImagePipeline"):
    """Qwen-Image text-to-image (the old `pipelines.qwen_image` class)."""


class QwenImageImageToImage(DiffusersAdapter, family=QwenImage, serves="QwenImageImg2ImgPipeline"):
    """Qwen-Image image-to-image (the old `pipelines.image_to_image` class)."""


class QwenImageInpaint(DiffusersAdapter, family=QwenImage, serves="QwenImageInpaintPipeline"):
    """Qwen-Image inpainting (the old `pipelines.inpainting` class)."""


class QwenImageEdit(DiffusersAdapter, family=QwenImage, serves="QwenImageEditPipeline"):
    """Qwen-Image-Edit (the old `pipelines.image_edit` class)."""


class QwenImageEditPlus(DiffusersAdapter, family=QwenImage, serves="QwenImageEditPlusPipeline"):
    """Qwen-Image-Edit-Plus, one to three input images (the old `pipelines.image_edit` class)."""


class StableDiffusion3TextToImage(
    DiffusersAdapter, family=StableDiffusion3, serves="StableDiffusion3Pipeline"
):
    """Stable Diffusion 3 / 3.5 text-to-image (the old `pipelines.sd3` class)."""


class WanTextToVideo(DiffusersAdapter, family=Wan, serves="WanPipeline"):
    """Wan text-to-video (the old `pipelines.wan` class)."""


class WanImageToVideo(DiffusersAdapter, family=Wan, serves="WanImageToVideoPipeline"):
    """Wan image-to-video (the old `pipelines.wan` class)."""


class LTXTextToVideo(DiffusersAdapter, family=LTX, serves="LTXPipeline"):
    """LTX-Video text-to-video (the old `pipelines.ltx` class)."""


class LTX2TextToVideo(DiffusersAdapter, family=LTX2, serves="LTX2Pipeline"):
    """LTX-2 text-to-video with audio (the old `pipelines.ltx` class)."""


class DiffusersTextToVideo(DiffusersAdapter, family=GenericVideo, task=TEXT_TO_VIDEO):
    """The generic text-to-video adapter (request level, Wan's `__call__` defaults)."""


class _ServesTask(ABCMeta):
    """`isinstance(pipeline, Inpainting)`: whether an adapter serves that task."""

    task_served: Task | None

    def __instancecheck__(cls, instance: Any) -> bool:
        return isinstance(instance, DiffusersAdapter) and getattr(instance, "task", None) is cls.task_served


class Inpainting(DiffusersAdapter, metaclass=_ServesTask):
    """Not a base any more: `isinstance(pipeline, Inpainting)` says whether it inpaints."""

    task_served: ClassVar[Task | None] = INPAINTING


# module:Class paths of configs, commands and docs before the layout.
_OLD_MODULES: dict[str, tuple[type[Pipeline], ...]] = {
    "pipelines.text_to_image": (),  # DiffusersTextToImage, below: DiffusersAdapter by name
    "pipelines.text_to_video": (DiffusersTextToVideo,),
    "pipelines.stable_diffusion": (StableDiffusionTextToImage,),
    "pipelines.sdxl": (StableDiffusionXLTextToImage,),
    "pipelines.sd3": (StableDiffusion3TextToImage,),
    "pipelines.flux": (FluxTextToImage,),
    "pipelines.qwen_image": (QwenImageTextToImage,),
    "pipelines.wan": (WanTextToVideo, WanImageToVideo),
    "pipelines.ltx": (LTXTextToVideo, LTX2TextToVideo),
    "pipelines.image_edit": (QwenImageEdit, QwenImageEditPlus),
    "pipelines.image_to_image": (
        StableDiffusionImageToImage,
        StableDiffusionXLImageToImage,
        FluxImageToImage,
        QwenImageImageToImage,
        # Inpainting lived here before pipelines/inpainting.py.
        StableDiffusionInpaint,
        QwenImageInpaint,
    ),
    "pipelines.inpainting": (StableDiffusionInpaint, StableDiffusionXLInpaint, FluxInpaint, QwenImageInpaint),
}
OLD_MODULES = frozenset(_OLD_MODULES)
ALIASES: dict[str, type[Pipeline]] = {
    f"{module}:{cls.__name__}": cls for module, classes in _OLD_MODULES.items() for cls in classes
}
ALIASES["pipelines.text_to_image:DiffusersTextToImage"] = DiffusersTextToImage
