"""The captioned shapes dataset: seeded, held-out pairs never drawn, captions parse back."""

from __future__ import annotations

import numpy as np
import pytest

from pipelines.trained.captions import (
    HELD_OUT_PAIRS,
    HELD_OUT_PROMPTS,
    HELD_OUT_SEEDS,
    CaptionAsk,
    ObjectAsk,
    SceneSpec,
    ShapeSpec,
    caption,
    parse_caption,
)
from pipelines.trained.dataset import IMAGE_SIZE, render, sample_batch, sample_scene


def test_the_same_seed_gives_the_same_batch_and_another_seed_another() -> None:
    first = sample_batch(np.random.default_rng(7), 16)
    again = sample_batch(np.random.default_rng(7), 16)
    other = sample_batch(np.random.default_rng(8), 16)
    assert np.array_equal(first[0], again[0]) and first[1] == again[1]
    assert first[1] != other[1]
    assert first[0].shape == (16, IMAGE_SIZE, IMAGE_SIZE, 3) and first[0].dtype == np.uint8


def test_training_scenes_never_draw_a_held_out_pair() -> None:
    rng = np.random.default_rng(0)
    drawn = {(s.colour, s.shape) for _ in range(2000) for s in sample_scene(rng).shapes}
    assert not drawn & HELD_OUT_PAIRS
    # Every colour and every shape is still drawn, with other partners.
    assert {c for c, _ in HELD_OUT_PAIRS} <= {c for c, _ in drawn}
    assert {s for _, s in HELD_OUT_PAIRS} <= {s for _, s in drawn}


def test_shapes_stay_inside_the_picture_apart_and_off_the_background_colour() -> None:
    rng = np.random.default_rng(1)
    for _ in range(500):
        scene = sample_scene(rng, allow_held_out=True)
        for i, shape in enumerate(scene.shapes):
            assert shape.colour != scene.background
            assert shape.cx - shape.side / 2 >= 0 and shape.cx + shape.side / 2 <= IMAGE_SIZE
            assert shape.cy - shape.side / 2 >= 0 and shape.cy + shape.side / 2 <= IMAGE_SIZE
            for other in scene.shapes[i + 1 :]:
                gap = (shape.side + other.side) / 2
                assert abs(shape.cx - other.cx) > gap or abs(shape.cy - other.cy) > gap


def test_captions_count_identical_shapes_and_list_different_ones() -> None:
    red = ShapeSpec("circle", "red", "small", 20, 20, 14)
    blue = ShapeSpec("square", "blue", "large", 44, 44, 24)
    assert caption(SceneSpec("white", (red, red))) == "two small red circles on a white background"
    assert caption(SceneSpec("orange", (red, blue))) == (
        "a small red circle and a large blue square on an orange background"
    )
    assert caption(SceneSpec("black", (blue,), "top left")) == (
        "a large blue square in the top left on a black background"
    )


def test_every_caption_parses_back_to_its_scene() -> None:
    rng = np.random.default_rng(2)
    for _ in range(300):
        scene = sample_scene(rng, allow_held_out=True)
        ask = parse_caption(caption(scene))
        assert ask.background == scene.background and ask.position == scene.position
        assert sorted((o.shape, o.colour, o.size) for o in ask.objects) == sorted(
            (s.shape, s.colour, s.size) for s in scene.shapes
        )


def test_parse_reads_captions_without_size_or_colour_and_refuses_others() -> None:
    assert parse_caption("A Red Triangle, on a blue background") == CaptionAsk(
        "blue", (ObjectAsk("triangle", "red", None),), None
    )
    assert parse_caption("three crosses").objects == (ObjectAsk("cross", None, None),) * 3
    with pytest.raises(ValueError, match="a dog"):
        parse_caption("a dog on a red background")


def test_the_held_out_prompts_parse_and_half_ask_for_held_out_pairs() -> None:
    assert len(HELD_OUT_PROMPTS) == len(HELD_OUT_SEEDS) == len(set(HELD_OUT_PROMPTS))
    asking = [
        any((o.colour, o.shape) in HELD_OUT_PAIRS for o in parse_caption(p).objects) for p in HELD_OUT_PROMPTS
    ]
    assert sum(asking) == len(HELD_OUT_PROMPTS) // 2


def test_render_paints_the_background_and_each_shape_in_its_colour() -> None:
    scene = SceneSpec("green", (ShapeSpec("square", "purple", "large", 32, 32, 24),))
    picture = render(scene)
    assert tuple(picture[0, 0]) == (30, 160, 50)
    assert tuple(picture[32, 32]) == (140, 50, 190)
