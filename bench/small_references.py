"""Qwen-Image-Edit-Plus (2509, 2511) with small references, so `diffbatch bench` can time
it on a CPU: serve the tiny model with `--pipeline-class bench.small_references:QwenImageEditPlusSmall`.

diffusers' call resizes every reference to about 1024x1024 pixels for the VAE whatever the
input's size, and (with no size asked) makes the output that big too: on the tiny model one
request then costs seconds of VAE encode and thousands of reference tokens per row, and a
closed-loop run takes far longer than the few minutes a comparison may. This class serves
references at `REFERENCE_AREA` pixels (diffusers' module constant `VAE_IMAGE_SIZE`, which
the stock call and ours both read: the same change the step tests make), so a bench's
64x64 input is read at 64x64 and the output follows it. Step and request level read the
same constant, so their ratio is a fair one; absolute figures are not the real model's.
"""

from __future__ import annotations

from typing import Self

from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as edit_plus

from pipelines.adapter import DiffusersAdapter
from pipelines.base import PipelineConfig
from pipelines.families.qwen_image import QwenImage

REFERENCE_AREA = 64 * 64  # the bench's input picture (64x64) at its own size


def use_reference_area(area: int) -> int:
    """Set the area (pixels) every Edit Plus reference is resized to for the VAE in this
    process; returns the previous one."""
    previous = int(edit_plus.VAE_IMAGE_SIZE)
    edit_plus.VAE_IMAGE_SIZE = area
    return previous


class QwenImageEditPlusSmall(DiffusersAdapter, family=QwenImage, serves="QwenImageEditPlusPipeline"):
    """The Edit Plus adapter with `REFERENCE_AREA` references (set in the serving process
    when the pipeline loads, not at import)."""

    @classmethod
    def load(cls, config: PipelineConfig) -> Self:
        use_reference_area(REFERENCE_AREA)
        return super().load(config)
