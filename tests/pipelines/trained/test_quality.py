"""The quality scorer reads the dataset's own pictures right and noise at chance."""

from __future__ import annotations

import numpy as np

from pipelines.trained.captions import HELD_OUT_PROMPTS, SceneSpec, ShapeSpec, caption
from pipelines.trained.dataset import render, sample_batch
from pipelines.trained.quality import (
    Accuracy,
    classify_coverage,
    coverage_box,
    read_picture,
    score,
    score_all,
)


def test_ground_truth_pictures_score_full_marks() -> None:
    images, captions, _ = sample_batch(np.random.default_rng(11), 300)
    rates = score_all(list(images), captions).rates()
    assert all(rate >= 0.99 for rate in rates.values()), rates
    assert set(rates) == {"background", "count", "colour", "shape", "object", "size", "position"}


def test_pictures_scored_against_other_captions_are_near_chance() -> None:
    images, captions, _ = sample_batch(np.random.default_rng(12), 300)
    rates = score_all(list(images), captions[1:] + captions[:1]).rates()
    # Chance: 1 in 8 colours (7 for shapes), 1 in 4 classes, 1 in 5 regions.
    assert rates["background"] < 0.25 and rates["colour"] < 0.3 and rates["shape"] < 0.45, rates
    assert rates["object"] < 0.15 and rates["position"] < 0.35, rates


def test_noise_scores_near_chance_on_the_held_out_prompts() -> None:
    rng = np.random.default_rng(13)
    noise = [rng.integers(0, 256, (64, 64, 3), dtype=np.uint8) for _ in HELD_OUT_PROMPTS]
    rates = score_all(noise, list(HELD_OUT_PROMPTS)).rates()
    assert rates["background"] < 0.25 and rates["colour"] < 0.3 and rates["object"] < 0.15, rates


def test_a_picture_is_read_as_its_scene() -> None:
    scene = SceneSpec(
        "blue",
        (
            ShapeSpec("triangle", "red", "large", 20, 22, 26),
            ShapeSpec("cross", "yellow", "small", 48, 48, 13),
        ),
    )
    reading = read_picture(render(scene))
    assert reading.background == "blue"
    assert [(s.shape, s.colour, s.size) for s in reading.shapes] == [
        ("triangle", "red", "large"),
        ("cross", "yellow", "small"),
    ]


def test_a_wrong_colour_costs_colour_and_object_but_not_shape() -> None:
    picture = render(SceneSpec("white", (ShapeSpec("circle", "red", "small", 18, 18, 14),), "top left"))
    accuracy = score(picture, "a small blue circle in the top left on a white background")
    assert accuracy.rates() == {
        "background": 1.0,
        "count": 1.0,
        "colour": 0.0,
        "shape": 1.0,
        "object": 0.0,
        "size": 1.0,
        "position": 1.0,
    }
    missing = score(picture, "two small red circles on a white background")
    assert missing.hits["colour"] == 1 and missing.totals["colour"] == 2 and missing.hits["count"] == 0


def test_coverage_gives_the_box_to_a_fraction_of_a_pixel_and_the_class() -> None:
    picture = render(SceneSpec("black", (ShapeSpec("square", "white", "small", 30.25, 30.25, 12.5),)))
    coverage = (picture[..., 0].astype(float) - 15) / (245 - 15)
    left, right, top, bottom = coverage_box(coverage)
    # Pillow's rectangles include their last row and column: a quarter pixel here.
    assert abs(left - 24.0) < 0.3 and abs(right - 36.5) < 0.3 and abs(bottom - top - 12.5) < 0.3
    assert classify_coverage(coverage, (left, right, top, bottom)) == "square"


def test_accuracy_adds_up_over_pictures() -> None:
    total = Accuracy()
    picture = render(SceneSpec("white", (ShapeSpec("circle", "red", "small", 32, 32, 14),)))
    total.merge(score(picture, caption(SceneSpec("white", (ShapeSpec("circle", "red", "small", 0, 0, 0),)))))
    total.merge(score(picture, "a small red square on a white background"))
    assert total.rates()["shape"] == 0.5 and "position" not in total.rates()


def test_a_blurred_small_square_is_still_a_square() -> None:
    # Decoders draw soft edges: the box must not grow with the blur, or corners read round.
    picture = render(SceneSpec("black", (ShapeSpec("square", "white", "small", 30.0, 30.0, 14.0),)))
    soft = picture.astype(float)
    for axis in (0, 1):  # A [1, 2, 1] / 4 blur, three times along each axis.
        for _ in range(3):
            soft = (np.roll(soft, 1, axis) + 2 * soft + np.roll(soft, -1, axis)) / 4
    assert [s.shape for s in read_picture(soft.round().astype(np.uint8)).shapes] == ["square"]
