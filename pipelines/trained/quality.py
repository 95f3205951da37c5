"""A ruler for image quality: does a picture show what its shapes caption asks for?

Pure numpy. `read_picture` finds the background colour (the border's median), the shapes
(connected regions that differ from the background), and for each its colour (nearest
palette entry to its interior's median), class (the best overlap of its mask with each
class drawn in its bounding box: corners, fill ratio and roundness decide), size and
region. `score` compares that reading with `parse_caption(caption)` (any phrasing the
training draws; an attribute the caption leaves out is not scored); `Accuracy` adds
scores up per attribute. `HELD_OUT_PROMPTS` (with `HELD_OUT_SEEDS`) is the fixed set the
benchmark and the acceptance figures use; half of it asks for colour-shape pairs that
training never draws. `PHRASING_PROMPTS` is the fixed set of other phrasings (issue 41).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import permutations

import numpy as np

from pipelines.trained.captions import PALETTE, CaptionAsk, ObjectAsk, parse_caption

ATTRIBUTES = ("background", "count", "colour", "shape", "object", "size", "position")
# A pixel belongs to a shape when its colour is this far (RGB, 0-255) from the background's.
_FOREGROUND_DISTANCE = 48.0
# Regions smaller than this many pixels are specks, not shapes (the smallest shape has ~70).
_MIN_AREA = 12
# Side (pixels) between the dataset's small (12-16) and large (22-28) shapes.
_LARGE_SIDE = 19.0
_REGION_CENTRES = {
    "top left": (18.0, 18.0),
    "top right": (46.0, 18.0),
    "bottom left": (18.0, 46.0),
    "bottom right": (46.0, 46.0),
    "center": (32.0, 32.0),
}
_NAMES = tuple(PALETTE)
_COLOURS = np.array([PALETTE[name] for name in _NAMES], dtype=np.float64)


@dataclass(frozen=True, slots=True)
class SeenShape:
    shape: str
    colour: str
    size: str
    region: str
    area: int


@dataclass(frozen=True, slots=True)
class Reading:
    """What a picture shows: its background colour and its shapes, largest first."""

    background: str
    shapes: tuple[SeenShape, ...]


def nearest_colour(rgb: np.ndarray) -> str:
    return _NAMES[int(np.argmin(np.linalg.norm(_COLOURS - rgb, axis=1)))]


def read_picture(image: np.ndarray) -> Reading:
    """Read a (H, W, 3) uint8 RGB picture."""
    pixels = image[..., :3].astype(np.float64)
    border = np.concatenate(
        [
            pixels[:2].reshape(-1, 3),
            pixels[-2:].reshape(-1, 3),
            pixels[:, :2].reshape(-1, 3),
            pixels[:, -2:].reshape(-1, 3),
        ]
    )
    background = np.median(border, axis=0)
    mask = np.linalg.norm(pixels - background, axis=2) > _FOREGROUND_DISTANCE
    labels = label_regions(mask)
    shapes = []
    for region in np.unique(labels[labels > 0]):
        region_mask = labels == region
        if region_mask.sum() >= _MIN_AREA:
            shapes.append(_read_shape(pixels, region_mask, background))
    shapes.sort(key=lambda s: -s.area)
    return Reading(nearest_colour(background), tuple(shapes))


def label_regions(mask: np.ndarray) -> np.ndarray:
    """4-connected regions of `mask`, numbered from 1 (0 outside): each pixel takes the
    smallest number among its neighbours until nothing changes."""
    height, width = mask.shape
    big = height * width + 1
    labels = np.where(mask, np.arange(1, big).reshape(height, width), big)
    while True:
        padded = np.pad(labels, 1, constant_values=big)
        neighbours = np.minimum.reduce(
            [padded[1:-1, 1:-1], padded[:-2, 1:-1], padded[2:, 1:-1], padded[1:-1, :-2], padded[1:-1, 2:]]
        )
        updated = np.where(mask, neighbours, big)
        if np.array_equal(updated, labels):
            return np.where(mask, labels, 0)
        labels = updated


def _read_shape(pixels: np.ndarray, region: np.ndarray, background: np.ndarray) -> SeenShape:
    # The interior (pixels whose 4 neighbours are in the shape) holds its true colour;
    # edge pixels are blends with the background.
    padded = np.pad(region, 1)
    interior = region & padded[:-2, 1:-1] & padded[2:, 1:-1] & padded[1:-1, :-2] & padded[1:-1, 2:]
    colour = np.median(pixels[interior] if interior.sum() >= 4 else pixels[region], axis=0)
    # Coverage: how much of each pixel the shape covers, read as the pixel's position
    # between the background and the shape's colour (edges are blends of both).
    direction = colour - background
    coverage = np.clip((pixels - background) @ direction / max(1.0, float(direction @ direction)), 0.0, 1.0)
    coverage = np.where(_dilate(region), coverage, 0.0)
    box = coverage_box(coverage)
    cx, cy = (box[0] + box[1]) / 2, (box[2] + box[3]) / 2
    region_name = min(
        _REGION_CENTRES, key=lambda r: (_REGION_CENTRES[r][0] - cx) ** 2 + (_REGION_CENTRES[r][1] - cy) ** 2
    )
    return SeenShape(
        shape=classify_coverage(coverage, box),
        colour=nearest_colour(colour),
        size="large" if max(box[1] - box[0], box[3] - box[2]) > _LARGE_SIDE else "small",
        region=region_name,
        area=int(region.sum()),
    )


def _dilate(mask: np.ndarray) -> np.ndarray:
    padded = np.pad(mask, 1)
    grown: np.ndarray = mask | padded[:-2, 1:-1] | padded[2:, 1:-1] | padded[1:-1, :-2] | padded[1:-1, 2:]
    return grown


def coverage_box(coverage: np.ndarray) -> tuple[float, float, float, float]:
    """The shape's bounding box to a fraction of a pixel (left, right, top, bottom).

    Its width is the sum of each column's largest coverage (edge columns count the share
    of their width the shape reaches into), centred on that profile's centroid; likewise
    its height. A blurred edge spreads the profile but keeps its sum, so a soft picture
    gets the same box as a sharp one rather than a box grown by its blur."""
    cols, rows = coverage.max(axis=0), coverage.max(axis=1)
    width, height = float(cols.sum()), float(rows.sum())
    cx = float((cols * (np.arange(cols.size) + 0.5)).sum()) / max(width, 1e-6)
    cy = float((rows * (np.arange(rows.size) + 0.5)).sum()) / max(height, 1e-6)
    return cx - width / 2, cx + width / 2, cy - height / 2, cy + height / 2


def class_templates(
    coverage_shape: tuple[int, int], box: tuple[float, float, float, float]
) -> dict[str, np.ndarray]:
    """Each shape class drawn to fill `box`, as coverage per pixel (4x4 samples a pixel)."""
    height, width = coverage_shape
    left, right, top, bottom = box
    offsets = (np.arange(4) + 0.5) / 4
    xs = ((np.arange(width)[:, None] + offsets).ravel() - (left + right) / 2) / max(0.5, (right - left) / 2)
    ys = ((np.arange(height)[:, None] + offsets).ravel() - (top + bottom) / 2) / max(0.5, (bottom - top) / 2)
    yy, xx = np.meshgrid(ys, xs, indexing="ij")
    inside = (np.abs(xx) <= 1) & (np.abs(yy) <= 1)
    shapes = {
        "circle": xx**2 + yy**2 <= 1.0,
        "square": inside,
        "triangle": inside & (np.abs(xx) <= (yy + 1) / 2),  # Apex up, base down.
        "cross": inside & ((np.abs(xx) <= 1 / 3) | (np.abs(yy) <= 1 / 3)),
    }
    return {name: drawn.reshape(height, 4, width, 4).mean(axis=(1, 3)) for name, drawn in shapes.items()}


def classify_coverage(coverage: np.ndarray, box: tuple[float, float, float, float]) -> str:
    """The class whose drawing in the shape's box differs least from its coverage."""
    templates = class_templates(coverage.shape, box)
    return min(templates, key=lambda name: float(np.abs(templates[name] - coverage).sum()))


@dataclass(slots=True)
class Accuracy:
    """Hits and totals per attribute, added up over pictures."""

    hits: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ATTRIBUTES, 0))
    totals: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ATTRIBUTES, 0))

    def add(self, attribute: str, hit: bool) -> None:
        self.hits[attribute] += int(hit)
        self.totals[attribute] += 1

    def merge(self, other: Accuracy) -> None:
        for attribute in ATTRIBUTES:
            self.hits[attribute] += other.hits[attribute]
            self.totals[attribute] += other.totals[attribute]

    def rates(self) -> dict[str, float]:
        return {a: self.hits[a] / self.totals[a] for a in ATTRIBUTES if self.totals[a]}

    def summary(self) -> str:
        return " ".join(f"{a} {100 * r:.0f}%" for a, r in self.rates().items())


def score(image: np.ndarray, caption: str) -> Accuracy:
    """How far `image` shows what `caption` asks for, per attribute."""
    return score_reading(read_picture(image), parse_caption(caption))


def score_reading(reading: Reading, ask: CaptionAsk) -> Accuracy:
    accuracy = Accuracy()
    if ask.background is not None:
        accuracy.add("background", reading.background == ask.background)
    accuracy.add("count", len(reading.shapes) == len(ask.objects))
    matched = _best_match(ask.objects, reading.shapes)
    for wanted, seen in zip(ask.objects, matched, strict=True):
        accuracy.add("shape", seen is not None and seen.shape == wanted.shape)
        if wanted.colour is not None:  # A caption that names no colour lets the picture choose.
            accuracy.add("colour", seen is not None and seen.colour == wanted.colour)
            accuracy.add(
                "object", seen is not None and (seen.shape, seen.colour) == (wanted.shape, wanted.colour)
            )
        if wanted.size is not None:
            accuracy.add("size", seen is not None and seen.size == wanted.size)
    if ask.position is not None and len(ask.objects) == 1:
        accuracy.add("position", matched[0] is not None and matched[0].region == ask.position)
    return accuracy


def _best_match(wanted: tuple[ObjectAsk, ...], seen: tuple[SeenShape, ...]) -> list[SeenShape | None]:
    """The assignment of seen shapes (the six largest) to asked ones that agrees most."""
    candidates: list[SeenShape | None] = [*seen[:6], *([None] * len(wanted))]

    def agreement(pairing: Iterable[SeenShape | None]) -> float:
        return sum(
            (s.colour == w.colour) + (s.shape == w.shape) + 0.5 * (s.size == w.size)
            for w, s in zip(wanted, pairing, strict=True)
            if s is not None
        )

    return list(max(permutations(candidates, len(wanted)), key=agreement))


def score_all(images: list[np.ndarray], captions: list[str]) -> Accuracy:
    total = Accuracy()
    for image, text in zip(images, captions, strict=True):
        total.merge(score(image, text))
    return total
