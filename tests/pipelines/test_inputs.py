"""Input images are reduced, aspect kept, to what the model needs, and never enlarged."""

from __future__ import annotations

import numpy as np

from pipelines.inputs import reduce_image
from tests.media import picture


def test_a_large_image_is_reduced_to_cover_the_target_with_its_aspect() -> None:
    reduced = reduce_image(picture(4000, 3000, seed=1), 64, 64, min_side=448)
    assert reduced.shape == (448, 597, 3) and reduced.dtype == np.uint8


def test_the_target_wins_over_the_minimum_side() -> None:
    assert reduce_image(picture(2000, 1000, seed=1), 1600, 400).shape == (800, 1600, 3)


def test_an_image_already_small_enough_is_the_same_array() -> None:
    image = picture(100, 80, seed=1)
    assert reduce_image(image, 64, 64, min_side=448) is image
