"""The bench's small-reference Edit Plus adapter: the area it sets is the one every
reference is sized at, and it is still the Edit Plus adapter (no model is loaded)."""

from __future__ import annotations

import numpy as np

from bench.small_references import REFERENCE_AREA, QwenImageEditPlusSmall, use_reference_area
from pipelines import qwen_edit_plus, registry


def test_references_and_output_follow_the_area_set() -> None:
    picture = np.zeros((64, 64, 3), np.uint8)
    previous = use_reference_area(REFERENCE_AREA)
    try:
        assert qwen_edit_plus.reference_sizes((picture, picture)) == ((64, 64), (64, 64))
        assert qwen_edit_plus.output_size((picture,), 16) == (64, 64)
    finally:
        use_reference_area(previous)
    assert qwen_edit_plus.reference_sizes((picture,)) == ((1024, 1024),)  # diffusers' own area again


def test_it_serves_edits_as_the_edit_plus_adapter_does() -> None:
    edit_plus = registry.QwenImageEditPlus  # the adapter the registry serves Edit Plus with
    assert QwenImageEditPlusSmall.use is edit_plus.use
    assert QwenImageEditPlusSmall.modality == "edit"
    assert QwenImageEditPlusSmall.input_image_count == edit_plus.input_image_count
