"""The shapes world's vocabulary and caption grammar: what a picture holds (a `SceneSpec`),
the caption that describes it, and the parse back from a caption to what it asks for.

Torch- and numpy-free: the dataset renders specs, the quality scorer parses captions.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# Colours shapes and backgrounds are painted in (RGB), far enough apart that the nearest
# entry names a pixel's colour unambiguously.
PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "orange": (250, 140, 0),
    "yellow": (250, 230, 30),
    "green": (30, 160, 50),
    "blue": (30, 70, 220),
    "purple": (140, 50, 190),
    "white": (245, 245, 245),
    "black": (15, 15, 15),
}
COLOURS = tuple(PALETTE)
SHAPES = ("circle", "square", "triangle", "cross")
PLURALS = {"circle": "circles", "square": "squares", "triangle": "triangles", "cross": "crosses"}
SIZES = ("small", "large")
# A single shape's position phrase names one of five regions of the picture.
POSITIONS = ("top left", "top right", "bottom left", "bottom right", "center")
COUNT_WORDS = {1: "a", 2: "two", 3: "three"}

# Colour-shape pairs never drawn in training: the held-out prompts ask for them to test
# composition (every colour and every shape is still seen with others).
HELD_OUT_PAIRS: frozenset[tuple[str, str]] = frozenset(
    {("red", "triangle"), ("blue", "circle"), ("yellow", "cross"), ("green", "square")}
)


@dataclass(frozen=True, slots=True)
class ShapeSpec:
    """One shape: its class, colour, size word, and centre and side in pixels."""

    shape: str
    colour: str
    size: str
    cx: float
    cy: float
    side: float


@dataclass(frozen=True, slots=True)
class SceneSpec:
    """A picture: its background colour, its shapes, and the single shape's position word."""

    background: str
    shapes: tuple[ShapeSpec, ...]
    position: str | None = None


@dataclass(frozen=True, slots=True)
class ObjectAsk:
    """One shape a caption asks for; a word the caption leaves out is None."""

    shape: str
    colour: str | None
    size: str | None


@dataclass(frozen=True, slots=True)
class CaptionAsk:
    """What a caption asks for: background, shapes (one entry per shape) and position."""

    background: str | None
    objects: tuple[ObjectAsk, ...]
    position: str | None


def caption(scene: SceneSpec) -> str:
    """The template caption of `scene`: identical shapes are counted ("two small red
    circles"), different ones listed ("a small red circle and a large blue square")."""
    first = scene.shapes[0]
    if all((s.shape, s.colour, s.size) == (first.shape, first.colour, first.size) for s in scene.shapes):
        count = len(scene.shapes)
        noun = first.shape if count == 1 else PLURALS[first.shape]
        objects = f"{COUNT_WORDS[count]} {first.size} {first.colour} {noun}"
    else:
        objects = " and ".join(f"a {s.size} {s.colour} {s.shape}" for s in scene.shapes)
    where = f" in the {scene.position}" if scene.position else ""
    article = "an" if scene.background[0] in "aeiou" else "a"
    return f"{objects}{where} on {article} {scene.background} background"


_NOUNS = {**{s: s for s in SHAPES}, **{p: s for s, p in PLURALS.items()}}
_COUNTS = {"a": 1, "an": 1, "one": 1, "two": 2, "three": 3}
_OBJECT = re.compile(
    rf"^(?P<count>{'|'.join(_COUNTS)})\s+(?:(?P<size>{'|'.join(SIZES)})\s+)?"
    rf"(?:(?P<colour>{'|'.join(COLOURS)})\s+)?(?P<noun>{'|'.join(_NOUNS)})$"
)
_BACKGROUND = re.compile(rf"\s+on\s+an?\s+(?P<colour>{'|'.join(COLOURS)})\s+background\s*$")
_POSITION = re.compile(rf"\s+in\s+the\s+(?P<position>{'|'.join(POSITIONS)})\s*$")


def parse_caption(text: str) -> CaptionAsk:
    """What a caption in the template grammar asks for; ValueError names what it cannot read."""
    rest = " ".join(text.lower().replace(",", " ").split())
    background = None
    if match := _BACKGROUND.search(rest):
        background, rest = match["colour"], rest[: match.start()]
    position = None
    if match := _POSITION.search(rest):
        position, rest = match["position"], rest[: match.start()]
    objects: list[ObjectAsk] = []
    for part in rest.split(" and "):
        match = _OBJECT.match(part.strip())
        if match is None:
            raise ValueError(f"cannot read the shapes in {part.strip()!r}")
        ask = ObjectAsk(_NOUNS[match["noun"]], match["colour"], match["size"])
        objects += [ask] * _COUNTS[match["count"]]
    return CaptionAsk(background, tuple(objects), position)


def vocabulary_text() -> str:
    """Every word the captions use, for fitting a tokenizer's merges to them."""
    words = [*COLOURS, *SHAPES, *PLURALS.values(), *SIZES, *COUNT_WORDS.values()]
    words += ["in", "the", "top", "left", "right", "bottom", "center", "on", "background", "and"]
    return " ".join(words)


# The fixed prompts the quality figures are measured on, each with its seed (HELD_OUT_SEEDS):
# every other one asks for a colour-shape pair of HELD_OUT_PAIRS, which training never draws.
HELD_OUT_PROMPTS = (
    "a small yellow cross and a small blue circle and a small purple cross on an orange background",
    "two small yellow circles on a white background",
    "a large red triangle in the top left on a green background",
    "a large white cross on an orange background",
    "a large blue circle and a large yellow square and a small white cross on a green background",
    "a small yellow circle on a blue background",
    "a small green square and a small white cross on a black background",
    "a small black cross in the top right on a white background",
    "a large green square and a small white cross on an orange background",
    "a large orange cross in the bottom left on a white background",
    "a small black circle and a small orange triangle and a small yellow cross on a red background",
    "a large black triangle in the bottom right on a blue background",
    "a large black circle and a small blue circle and a large purple triangle on a white background",
    "a small white circle and a small yellow square and a large red cross on a black background",
    "a small red triangle and a large green triangle on a blue background",
    "a small black square and a small orange square on a green background",
    "a large yellow square and a large yellow cross on a black background",
    "a small white circle in the center on a yellow background",
    "a small red triangle and a large white square on a black background",
    "a small white circle and a large black cross on a purple background",
    "a small yellow cross in the top left on an orange background",
    "a small green triangle in the top left on a blue background",
    "a small blue circle in the top right on a red background",
    "a small purple square in the top left on an orange background",
    "a large yellow cross in the top right on a black background",
    "a small green circle on a red background",
    "a large blue circle on a yellow background",
    "a small red square on a purple background",
    "two large red triangles on an orange background",
    "a small blue square in the top right on a yellow background",
    "a small blue circle in the center on a white background",
    "three large black circles on a blue background",
)
HELD_OUT_SEEDS = tuple(range(1000, 1000 + len(HELD_OUT_PROMPTS)))
