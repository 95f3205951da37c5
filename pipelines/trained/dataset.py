"""A captioned synthetic dataset, generated on the fly: 64x64 pictures of one to three
shapes on a coloured background, each with a caption in a phrasing drawn at random
(pipelines/trained/phrasing.py; the template among them).

Seeded (numpy `Generator`), no download, numpy and Pillow only. Training scenes never draw
a colour-shape pair of `HELD_OUT_PAIRS`.
"""

from __future__ import annotations

import numpy as np
from PIL import Image, ImageDraw

from pipelines.trained.captions import (
    COLOURS,
    HELD_OUT_PAIRS,
    PALETTE,
    POSITIONS,
    SHAPES,
    SIZES,
    SceneSpec,
    ShapeSpec,
)
from pipelines.trained.phrasing import phrase

IMAGE_SIZE = 64
# Side ranges in pixels per size word, and the margin kept from the picture's edge.
SIDES = {"small": (12.0, 16.0), "large": (22.0, 28.0)}
_MARGIN = 2.0
# Centres of the position regions, as fractions of the picture (jittered when drawn).
_REGION_CENTRES = {
    "top left": (0.28, 0.28),
    "top right": (0.72, 0.28),
    "bottom left": (0.28, 0.72),
    "bottom right": (0.72, 0.72),
    "center": (0.5, 0.5),
}
# Drawn this many times larger, then reduced: smooth edges, as a real picture has.
_SUPERSAMPLE = 4


def sample_scene(rng: np.random.Generator, *, allow_held_out: bool = False) -> SceneSpec:
    """A random scene: one shape (half the time, usually with a position word), two or
    three (half of those identical, so the caption counts them)."""
    background = COLOURS[rng.integers(len(COLOURS))]
    count = int(rng.choice([1, 2, 3], p=[0.5, 0.3, 0.2]))
    kinds = [_sample_kind(rng, background, allow_held_out)]
    identical = count > 1 and rng.random() < 0.5
    for _ in range(count - 1):
        kinds.append(kinds[0] if identical else _sample_kind(rng, background, allow_held_out))
    if count == 1 and rng.random() < 0.7:
        position = POSITIONS[rng.integers(len(POSITIONS))]
        shape, colour, size = kinds[0]
        return SceneSpec(background, (_place_in_region(rng, shape, colour, size, position),), position)
    return SceneSpec(background, _place_apart(rng, kinds))


def _sample_kind(rng: np.random.Generator, background: str, allow_held_out: bool) -> tuple[str, str, str]:
    while True:
        shape = SHAPES[rng.integers(len(SHAPES))]
        colour = COLOURS[rng.integers(len(COLOURS))]
        if colour != background and (allow_held_out or (colour, shape) not in HELD_OUT_PAIRS):
            return shape, colour, SIZES[rng.integers(len(SIZES))]


def _side(rng: np.random.Generator, size: str) -> float:
    low, high = SIDES[size]
    return float(rng.uniform(low, high))


def _place_in_region(
    rng: np.random.Generator, shape: str, colour: str, size: str, position: str
) -> ShapeSpec:
    side = _side(rng, size)
    fx, fy = _REGION_CENTRES[position]
    low, high = side / 2 + _MARGIN, IMAGE_SIZE - side / 2 - _MARGIN
    cx = float(np.clip(fx * IMAGE_SIZE + rng.uniform(-4, 4), low, high))
    cy = float(np.clip(fy * IMAGE_SIZE + rng.uniform(-4, 4), low, high))
    return ShapeSpec(shape, colour, size, cx, cy, side)


def _place_apart(rng: np.random.Generator, kinds: list[tuple[str, str, str]]) -> tuple[ShapeSpec, ...]:
    """Shapes at random places whose boxes keep a 3-pixel gap (retried until they fit;
    large shapes are shrunk to small ones if three large ones cannot be placed)."""
    for attempt in range(200):
        placed: list[ShapeSpec] = []
        for shape, colour, size in kinds:
            side = _side(rng, size)
            low, high = side / 2 + _MARGIN, IMAGE_SIZE - side / 2 - _MARGIN
            cx, cy = float(rng.uniform(low, high)), float(rng.uniform(low, high))
            if all(
                abs(cx - p.cx) > (side + p.side) / 2 + 3 or abs(cy - p.cy) > (side + p.side) / 2 + 3
                for p in placed
            ):
                placed.append(ShapeSpec(shape, colour, size, cx, cy, side))
        if len(placed) == len(kinds):
            return tuple(placed)
        if attempt == 100:
            kinds = [(shape, colour, "small") for shape, colour, _ in kinds]
    raise RuntimeError("could not place the shapes apart")  # pragma: no cover - never seen


def render(scene: SceneSpec) -> np.ndarray:
    """The scene as a (64, 64, 3) uint8 RGB array."""
    big = IMAGE_SIZE * _SUPERSAMPLE
    image = Image.new("RGB", (big, big), PALETTE[scene.background])
    draw = ImageDraw.Draw(image)
    for spec in scene.shapes:
        fill = PALETTE[spec.colour]
        cx, cy, half = (v * _SUPERSAMPLE for v in (spec.cx, spec.cy, spec.side / 2))
        draw_shape(draw, shape=spec.shape, cx=cx, cy=cy, half=half, fill=fill)
    return np.asarray(image.resize((IMAGE_SIZE, IMAGE_SIZE), Image.Resampling.BOX))


def draw_shape(
    draw: ImageDraw.ImageDraw,
    *,
    shape: str,
    cx: float,
    cy: float,
    half: float,
    fill: tuple[int, int, int] | int,
) -> None:
    """Draw one shape whose bounding box is the square of half-side `half` around (cx, cy)."""
    box = (cx - half, cy - half, cx + half, cy + half)
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        draw.rectangle(box, fill=fill)
    elif shape == "triangle":
        draw.polygon([(cx, cy - half), (cx + half, cy + half), (cx - half, cy + half)], fill=fill)
    elif shape == "cross":
        arm = half / 3
        draw.rectangle((cx - arm, cy - half, cx + arm, cy + half), fill=fill)
        draw.rectangle((cx - half, cy - arm, cx + half, cy + arm), fill=fill)
    else:
        raise ValueError(f"unknown shape {shape!r}")


def sample_batch(rng: np.random.Generator, size: int) -> tuple[np.ndarray, list[str], list[SceneSpec]]:
    """`size` training pictures (uint8, (N, 64, 64, 3)), their captions and their scenes."""
    scenes = [sample_scene(rng) for _ in range(size)]
    images = np.stack([render(scene) for scene in scenes])
    return images, [phrase(scene, rng) for scene in scenes], scenes
