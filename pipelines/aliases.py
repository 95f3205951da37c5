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
from pipelines.edit_mixins import Inpainting as _OldInpainting
from pipelines.families.base import GenericVideo
from pipelines.flux import FluxTextToImage
from pipelines.image_edit import QwenImageEdit, QwenImageEditPlus
from pipelines.image_to_image import (
    FluxImageToImage,
    QwenImageImageToImage,
    StableDiffusionImageToImage,
    StableDiffusionXLImageToImage,
)
from pipelines.inpainting import (
    FluxInpaint,
    QwenImageInpaint,
    StableDiffusionInpaint,
    StableDiffusionXLInpaint,
)
from pipelines.ltx import LTX2TextToVideo, LTXTextToVideo
from pipelines.qwen_image import QwenImageTextToImage
from pipelines.sd3 import StableDiffusion3TextToImage
from pipelines.sdxl import StableDiffusionXLTextToImage
from pipelines.stable_diffusion import StableDiffusionTextToImage
from pipelines.stepping.preview import MIN_IMAGES, LinearPreview
from pipelines.tasks.base import Task
from pipelines.tasks.video import TEXT_TO_VIDEO
from pipelines.text_to_image import DiffusersTextToImage as _OldTextToImage
from pipelines.wan import WanImageToVideo, WanTextToVideo

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
# Until every family is ported, an old adapter is a (virtual) `DiffusersAdapter` too.
DiffusersAdapter.register(_OldTextToImage)


class DiffusersTextToVideo(DiffusersAdapter, family=GenericVideo, task=TEXT_TO_VIDEO):
    """The generic text-to-video adapter (request level, Wan's `__call__` defaults)."""


class _ServesTask(ABCMeta):
    """`isinstance(pipeline, Inpainting)`: whether an adapter serves that task."""

    task_served: Task | None
    old_classes: tuple[type, ...]

    def __instancecheck__(cls, instance: Any) -> bool:
        if isinstance(instance, cls.old_classes):
            return True
        return isinstance(instance, DiffusersAdapter) and getattr(instance, "task", None) is cls.task_served


class Inpainting(DiffusersAdapter, metaclass=_ServesTask):
    """Not a base any more: `isinstance(pipeline, Inpainting)` says whether it inpaints."""

    task_served: ClassVar[Task | None] = None
    old_classes: ClassVar[tuple[type, ...]] = (_OldInpainting,)


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
