"""Fixtures of the pipeline tests. `small_edit_references`: Qwen-Image-Edit (2509) with its
input image at a small area, in this process.

`QwenImageEditPipeline.__call__` resizes the input image to about 1024x1024 pixels
(`calculate_dimensions(1024 * 1024, ratio)`, the area written in the call) for both
Qwen2.5-VL and the VAE, whatever its size, and makes the output that big when no size is
asked: on the tiny model one request then costs seconds of VAE and vision encoder and 4096
reference tokens per row. `small_edit_references` wraps diffusers' `calculate_dimensions`
so that area becomes `SMALL_EDIT_AREA` for the stock call and for ours
(`pipelines.tasks.reference_edit` reads the function from diffusers' module at each call):
the same code with a smaller number, as the Edit Plus tests do with `VAE_IMAGE_SIZE`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit

SMALL_EDIT_AREA = 128 * 128
_CALL_AREA = 1024 * 1024  # the area `QwenImageEditPipeline.__call__` writes


@pytest.fixture
def small_edit_references(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    original = pipeline_qwenimage_edit.calculate_dimensions

    def smaller(target_area: float, ratio: float) -> Any:
        return original(SMALL_EDIT_AREA if target_area == _CALL_AREA else target_area, ratio)

    monkeypatch.setattr(pipeline_qwenimage_edit, "calculate_dimensions", smaller)
    yield
