"""The captioned shapes dataset: seeded, held-out pairs never drawn, captions parse back."""

from __future__ import annotations

import numpy as np
import pytest

from pipelines.trained.captions import (
    HELD_OUT_PAIRS,
    HELD_OUT_PROMPTS,
    HELD_OUT_SEEDS,
    PHRASING_PROMPTS,
    PHRASING_SEEDS,
    CaptionAsk,
    ObjectAsk,
    SceneSpec,
    ShapeSpec,
    caption,
    normalise,
    parse_caption,
)
from pipelines.trained.dataset import IMAGE_SIZE, render, sample_batch, sample_scene
from pipelines.trained.phrasing import phrase


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


def test_the_parser_reads_every_phrasing_form_training_draws() -> None:
    """Each drawn phrasing parses back to its scene, but for what it leaves out (None)."""
    rng = np.random.default_rng(3)
    seen: set[str] = set()
    for _ in range(3000):
        scene = sample_scene(rng, allow_held_out=True)
        text = phrase(scene, rng)
        ask = parse_caption(text)
        assert ask.background in (None, scene.background), text
        assert ask.position in (None, scene.position), text
        assert sorted(o.shape for o in ask.objects) == sorted(s.shape for s in scene.shapes), text
        for wanted, shape in zip(ask.objects, scene.shapes, strict=True):  # in the scene's order
            assert wanted.colour in (None, shape.colour) and wanted.size in (None, shape.size), text
        seen |= set(normalise(text).split())
    # The draws hold every form: fillers, counts in digits, synonyms, regions, backgrounds.
    assert {"1", "2", "3", "one", "big", "tiny", "upper", "lower", "corner", "middle", "centre"} <= seen
    assert {"picture", "image", "drawing", "please", "draw", "with", "at", ","} <= seen


def test_parse_reads_the_phrasings_people_write() -> None:
    red_circle = (ObjectAsk("circle", "red", None),)
    for text in (
        "a red circle on a blue background",
        "A red circle, blue background.",
        "please draw one red circle on blue!",
        "a picture of a red circle with a blue background",
    ):
        assert parse_caption(text) == CaptionAsk("blue", red_circle, None), text
    assert parse_caption("2 big red circles in the upper left corner") == CaptionAsk(
        None, (ObjectAsk("circle", "red", "large"),) * 2, "top left"
    )
    assert parse_caption("Draw a red tiny square on white in the middle") == CaptionAsk(
        "white", (ObjectAsk("square", "red", "small"),), "center"
    )
    assert parse_caption("a red circle, a blue square and 3 crosses").objects == (
        ObjectAsk("circle", "red", None),
        ObjectAsk("square", "blue", None),
        *(ObjectAsk("cross", None, None),) * 3,
    )
    for unreadable in ("red circles on blue", "a red blue circle", "on a blue background"):
        with pytest.raises(ValueError):
            parse_caption(unreadable)


def test_phrasings_keep_the_template_and_never_draw_a_phrasing_prompt() -> None:
    rng = np.random.default_rng(4)
    scene = SceneSpec("blue", (ShapeSpec("circle", "red", "large", 32, 32, 24),))
    drawn = [phrase(scene, rng) for _ in range(2000)]
    assert "a large red circle on a blue background" in drawn  # the template
    assert len(set(drawn)) > 50
    assert not {normalise(t) for t in drawn} & {normalise(p) for p in PHRASING_PROMPTS}
    # Without the redraw this scene's phrasings would hit one of them.
    assert any(normalise(p) == "a red circle on a blue background" for p in PHRASING_PROMPTS)


def test_the_phrasing_prompts_parse_and_none_is_in_the_template() -> None:
    assert len(PHRASING_PROMPTS) == len(PHRASING_SEEDS) == len(set(PHRASING_PROMPTS))
    assert not set(PHRASING_SEEDS) & set(HELD_OUT_SEEDS)
    for prompt in PHRASING_PROMPTS:
        ask = parse_caption(prompt)
        assert normalise(prompt) not in {normalise(p) for p in HELD_OUT_PROMPTS}
        assert ask.objects, prompt


def test_render_paints_the_background_and_each_shape_in_its_colour() -> None:
    scene = SceneSpec("green", (ShapeSpec("square", "purple", "large", 32, 32, 24),))
    picture = render(scene)
    assert tuple(picture[0, 0]) == (30, 160, 50)
    assert tuple(picture[32, 32]) == (140, 50, 190)
