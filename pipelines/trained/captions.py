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


# Words and phrases beyond the template that captions may use (pipelines/trained/phrasing.py
# draws them in training; `parse_caption` reads them all): size synonyms, counts as words or
# digits, ways to name a region and the background, and filler openings.
SIZE_WORDS = {"small": "small", "tiny": "small", "large": "large", "big": "large"}
COUNT_FORMS = {1: ("a", "one", "1"), 2: ("two", "2"), 3: ("three", "3")}
VERTICAL_WORDS = {"top": "top", "upper": "top", "bottom": "bottom", "lower": "bottom"}
CENTRE_WORDS = ("center", "centre", "middle")
FILLERS = ("a picture of", "an image of", "a drawing of", "please draw", "draw")
# A new word's embedding starts as its synonym's when a trained model learns the new words.
SYNONYMS = {
    "tiny": "small",
    "big": "large",
    "upper": "top",
    "lower": "bottom",
    "centre": "center",
    "middle": "center",
}

_NOUNS = {**{s: s for s in SHAPES}, **{p: s for s, p in PLURALS.items()}}
_COUNTS = {"an": 1, **{form: n for n, forms in COUNT_FORMS.items() for form in forms}}
_COLOUR = "|".join(COLOURS)
_OBJECT = re.compile(
    rf"^(?:(?P<count>{'|'.join(_COUNTS)})\s+)?(?P<words>(?:(?:{'|'.join(SIZE_WORDS)}|{_COLOUR})\s+)*)"
    rf"(?P<noun>{'|'.join(_NOUNS)})$"
)
# The background's forms, tried in order: "on a blue background", "with a blue background",
# "blue background", "on blue".
_BACKGROUNDS = (
    re.compile(rf"(?:^|\s)(?:on|with)\s+(?:an?\s+)?(?P<colour>{_COLOUR})\s+background(?=\s|$)"),
    re.compile(rf"(?:^|\s)(?P<colour>{_COLOUR})\s+background(?=\s|$)"),
    re.compile(rf"(?:^|\s)on\s+(?P<colour>{_COLOUR})(?=\s|$)"),
)
_POSITION = re.compile(
    rf"(?:^|\s)(?:(?:in|at)\s+the\s+)?(?:(?P<vertical>{'|'.join(VERTICAL_WORDS)})\s+(?P<side>left|right)"
    rf"(?:\s+corner)?|(?P<centre>{'|'.join(CENTRE_WORDS)}))(?=\s|$)"
)
_FILLER = re.compile(rf"^(?:{'|'.join(FILLERS)})\s+")


def normalise(text: str) -> str:
    """Lower case, punctuation apart from commas dropped, hyphens as spaces, one space
    between words: the form captions are compared and parsed in."""
    text = re.sub(r"[.!?;:]", " ", text.lower().replace("-", " ")).replace(",", " , ")
    return " ".join(text.split())


def parse_caption(text: str) -> CaptionAsk:
    """What a caption asks for, in any of the forms `pipelines.trained.phrasing` draws (the
    template among them): ValueError names what it cannot read. A word the caption leaves
    out (size, colour, background, position) is None: the picture may choose it."""
    rest = normalise(text)
    while match := _FILLER.match(rest):
        rest = rest[match.end() :]
    background = None
    for form in _BACKGROUNDS:
        if match := form.search(rest):
            background, rest = match["colour"], rest[: match.start()] + rest[match.end() :]
            break
    position = None
    if match := _POSITION.search(rest):
        vertical = VERTICAL_WORDS.get(match["vertical"] or "")
        position = "center" if match["centre"] else f"{vertical} {match['side']}"
        rest = rest[: match.start()] + rest[match.end() :]
    objects: list[ObjectAsk] = []
    for part in re.split(r"\s*,\s*|\s+and\s+", rest):
        if part.strip():
            objects += _parse_objects(part.strip())
    if not objects:
        raise ValueError(f"no shape in {text!r}")
    return CaptionAsk(background, tuple(objects), position)


def _parse_objects(part: str) -> list[ObjectAsk]:
    """One counted group: "a small red circle", "2 red squares", "one big cross"."""
    match = _OBJECT.match(part)
    if match is None:
        raise ValueError(f"cannot read the shapes in {part!r}")
    words = match["words"].split()
    sizes = [SIZE_WORDS[w] for w in words if w in SIZE_WORDS]
    colours = [w for w in words if w in PALETTE]
    if len(sizes) > 1 or len(colours) > 1:
        raise ValueError(f"more than one size or colour in {part!r}")
    noun = match["noun"]
    if match["count"] is None and noun in PLURALS.values():
        raise ValueError(f"how many {noun} in {part!r}")
    count = 1 if match["count"] is None else _COUNTS[match["count"]]
    ask = ObjectAsk(_NOUNS[noun], colours[0] if colours else None, sizes[0] if sizes else None)
    return [ask] * count


def vocabulary_text(*, capitals: bool = False) -> str:
    """Every word the captions use, for fitting a tokenizer to them (digits are single
    characters to any tokenizer already); with `capitals`, each also with a capital first
    letter, for a tokenizer that does not lower-case (T5's)."""
    words = [*COLOURS, *SHAPES, *PLURALS.values(), *SIZE_WORDS, *COUNT_WORDS.values(), "an"]
    words += [form for forms in COUNT_FORMS.values() for form in forms if form.isalpha()]
    words += [*VERTICAL_WORDS, "left", "right", "corner", *CENTRE_WORDS, "in", "at", "the", "on", "with"]
    words += ["background", "and", *(w for filler in FILLERS for w in filler.split())]
    if capitals:
        words += [word.capitalize() for word in words]
    return " ".join(dict.fromkeys(words))


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

# The fixed phrasing held-out set: newcomers' phrasings, none of them the template's, each with
# its seed (PHRASING_SEEDS). Written before the first run trained on phrasings and kept fixed:
# the first three are the issue's own (41), the rest a seeded draw (numpy seed 41) of scenes
# and phrasings from pipelines/trained/phrasing.py. Training redraws any caption equal to one
# of them, so these exact captions are never trained on; unlike HELD_OUT_PROMPTS they ask for
# any colour-shape pair (a held-out pair only by chance).
PHRASING_PROMPTS = (
    "a red circle on a blue background",
    "a white square on a red background",
    "a blue circle on a yellow background",
    "two large yellow circles with a purple background",
    "A yellow circle top right, blue background",
    "a picture of a blue tiny square and a green tiny circle with a purple background",
    "a blue cross at the top left, purple background",
    "one purple cross, blue background",
    "One white triangle in the upper left on purple",
    "a large black square with an orange background.",
    "draw a small white square, a small blue circle and a small purple triangle with a green background",
    "draw one large blue cross top right on red",
    "A black cross on blue",
    "A large purple square on a red background at the upper left",
    "a small green triangle on white in the lower right corner",
    "a black circle in the top left corner with a yellow background",
    "a black square and a red triangle on purple!",
    "an orange circle on a purple background.",
    "please draw a small red cross on orange",
    "draw 1 blue triangle with a white background in the middle",
    "one large green cross on a red background",
    "2 purple circles on a yellow background",
    "three orange squares on white",
    "two white circles, red background",
    "a green cross and a purple cross on a blue background",
    "Draw two small yellow squares",
    "a large white triangle at the top left on a yellow background",
    "A large blue triangle in the middle with an orange background",
    "a big red square on a white background in the bottom right corner!",
    "A picture of a large red square bottom right with an orange background",
    "two black small triangles, red background!",
    "an orange circle, blue background",
)
PHRASING_SEEDS = tuple(range(2000, 2000 + len(PHRASING_PROMPTS)))
