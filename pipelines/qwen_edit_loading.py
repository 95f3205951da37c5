"""Loading Qwen-Image-Edit pipelines (QwenImageEditPipeline, QwenImageEditPlusPipeline) and
Qwen-Image 2.1 (QwenImage21Pipeline, whose Qwen3VLProcessor has the same trouble) without
torchvision.

Both pipelines take a `processor` component, a transformers `Qwen2VLProcessor` (an image
processor and a tokenizer, saved in the model's `processor/` folder). In transformers 5 that
processor also owns a video processor, and both the video processor and the default image
processor import torchvision; worse, `Qwen2VLProcessor.__init__` type-checks its video
processor against a class that transformers only exports with torchvision installed, so
without torchvision the processor can be neither built nor loaded, even with no video. PyPI's
torchvision does not import beside the CPU torch this project pins, so the plain
`DiffusionPipeline.from_pretrained(path)` fails for these models on such hosts.

The pipelines never pass videos, so the adaptation is confined to this module: a
`Qwen2VLProcessor` whose only sub-processors are an image processor and a tokenizer, its
image processor being transformers' PIL-backed `Qwen2VLImageProcessorPil` (same resizing and
patching as the torchvision-backed `Qwen2VLImageProcessor`). `load_qwen_image_edit` builds
it from the `processor/` folder and hands it to `from_pretrained`, which loads every other
component as usual; it is used on every host, with or without torchvision, so each host
preprocesses alike. The same `processor/` layout (a `preprocessor_config.json` or a
`processor_config.json`, and the tokenizer's files) serves the real repositories
(Qwen/Qwen-Image-Edit, Qwen/Qwen-Image-Edit-2509) and the tiny model; the pipeline class
comes from the model's `model_index.json`.
"""

from __future__ import annotations

from typing import Any

from diffusers import DiffusionPipeline
from transformers import Qwen2Tokenizer, Qwen2VLProcessor, Qwen3VLProcessor
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil


class ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):  # type: ignore[misc]
    """A Qwen2VLProcessor without a video processor: images and text only.

    transformers reads a processor's sub-processors from its `__init__` signature, so leaving
    `video_processor` out of the signature is what drops it. Saved, it names the stock class
    it stands in for, so its files are those of a `Qwen2VLProcessor`.
    """

    def __init__(
        self,
        image_processor: Any = None,
        tokenizer: Any = None,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    def to_dict(self) -> dict[str, Any]:
        serialized: dict[str, Any] = super().to_dict()
        serialized["processor_class"] = Qwen2VLProcessor.__name__
        return serialized


def load_qwen_image_processor(path: str) -> ImageOnlyQwen2VLProcessor:
    """The image-and-text processor saved in `path`'s `processor/` folder (local or hub id)."""
    return ImageOnlyQwen2VLProcessor(
        image_processor=Qwen2VLImageProcessorPil.from_pretrained(path, subfolder="processor"),
        tokenizer=Qwen2Tokenizer.from_pretrained(path, subfolder="processor"),
    )


def load_qwen_image_edit(path: str, dtype: Any, **kwargs: Any) -> DiffusionPipeline:
    """A Qwen-Image-Edit pipeline (either class) from a local directory or a hub id; `kwargs`
    go to `from_pretrained` (quantization, a replacement transformer)."""
    processor = load_qwen_image_processor(path)
    return DiffusionPipeline.from_pretrained(path, dtype=dtype, processor=processor, **kwargs)


class ImageOnlyQwen3VLProcessor(Qwen3VLProcessor):  # type: ignore[misc]
    """Qwen-Image 2.1's Qwen3VLProcessor without a video processor, as above."""

    def __init__(
        self,
        image_processor: Any = None,
        tokenizer: Any = None,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    def to_dict(self) -> dict[str, Any]:
        serialized: dict[str, Any] = super().to_dict()
        serialized["processor_class"] = Qwen3VLProcessor.__name__
        return serialized


def load_qwen_image_21(path: str, dtype: Any = None, **kwargs: Any) -> DiffusionPipeline:
    """A QwenImage21Pipeline from a local directory or a hub id, its processor built from the
    `processor/` folder (the chat template, which the pipeline reads to count the system
    prefix it drops, is the tokenizer's `chat_template.jinja`)."""
    tokenizer = Qwen2Tokenizer.from_pretrained(path, subfolder="processor")
    processor = ImageOnlyQwen3VLProcessor(
        image_processor=Qwen2VLImageProcessorPil.from_pretrained(path, subfolder="processor"),
        tokenizer=tokenizer,
        chat_template=tokenizer.chat_template,
    )
    return DiffusionPipeline.from_pretrained(path, dtype=dtype, processor=processor, **kwargs)
