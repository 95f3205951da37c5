"""Captions in many phrasings: the same scene described the way people write, drawn at random
per training example, so a model follows "a red circle on blue" as well as the template.

Each phrasing is drawn from the forms `parse_caption` reads (captions.py holds the words):
the template itself a quarter of the time; otherwise sizes said or not ("big", "tiny" too),
counts as words or digits, colour and size in either order, the region in several forms or
not at all, the background in four forms (rarely left out), a filler opening, a capital and
an end mark. A caption that leaves a property out lets the model choose it. The phrasing
held-out prompts (`PHRASING_PROMPTS`) are never drawn: a draw that equals one is redrawn.
"""

from __future__ import annotations

import numpy as np

from pipelines.trained.captions import (
    CENTRE_WORDS,
    COUNT_FORMS,
    FILLERS,
    PHRASING_PROMPTS,
    PLURALS,
    SceneSpec,
    ShapeSpec,
    caption,
    normalise,
)

# The template's share of the captions: the form the held-out template prompts use.
TEMPLATE_SHARE = 0.25
_HELD_OUT = frozenset(normalise(prompt) for prompt in PHRASING_PROMPTS)
_SIZE_SYNONYMS = {"small": "tiny", "large": "big"}
_VERTICAL_SYNONYMS = {"top": "upper", "bottom": "lower"}


def phrase(scene: SceneSpec, rng: np.random.Generator) -> str:
    """A caption of `scene` in a phrasing drawn from `rng`, never a held-out phrasing prompt."""
    while True:
        text = caption(scene) if rng.random() < TEMPLATE_SHARE else _draw(scene, rng)
        if normalise(text) not in _HELD_OUT:
            return text


def _draw(scene: SceneSpec, rng: np.random.Generator) -> str:
    with_size, with_colour = rng.random() < 0.6, rng.random() < 0.95
    colour_first = rng.random() < 0.2
    groups: list[tuple[ShapeSpec, int]] = []
    for spec in scene.shapes:
        if groups and (groups[-1][0].shape, groups[-1][0].colour, groups[-1][0].size) == (
            spec.shape,
            spec.colour,
            spec.size,
        ):
            groups[-1] = (groups[-1][0], groups[-1][1] + 1)
        else:
            groups.append((spec, 1))
    parts = [
        _objects(rng, spec, n, size=with_size, colour=with_colour, colour_first=colour_first)
        for spec, n in groups
    ]
    if len(parts) > 2 and rng.random() < 0.5:
        text = ", ".join(parts[:-1]) + " and " + parts[-1]
    else:
        text = " and ".join(parts)
    where = _position(rng, scene.position) if scene.position and rng.random() < 0.75 else ""
    ground = _background(rng, scene.background) if rng.random() < 0.95 else ""
    tail = [where, ground] if rng.random() < 0.7 else [ground, where]
    for clause in tail:
        if clause:
            text += clause if clause.startswith(",") else f" {clause}"
    if rng.random() < 0.2:
        text = f"{FILLERS[rng.integers(len(FILLERS))]} {text}"
    if rng.random() < 0.3:
        text = text[0].upper() + text[1:]
    if rng.random() < 0.2:
        text += "." if rng.random() < 0.8 else "!"
    return text


def _objects(
    rng: np.random.Generator,
    spec: ShapeSpec,
    count: int,
    *,
    size: bool,
    colour: bool,
    colour_first: bool,
) -> str:
    """One group of identical shapes, with its size and colour words or not: "a big red
    circle", "2 blue squares", "one cross"."""
    words = []
    if size:
        words.append(_SIZE_SYNONYMS[spec.size] if rng.random() < 0.15 else spec.size)
    if colour:
        words.insert(0 if colour_first else len(words), spec.colour)
    words.append(spec.shape if count == 1 else PLURALS[spec.shape])
    forms = COUNT_FORMS[count]
    number = forms[0] if rng.random() < 0.75 else forms[1 + rng.integers(len(forms) - 1)]
    if number == "a" and words[0][0] in "aeiou":
        number = "an"
    return " ".join([number, *words])


def _position(rng: np.random.Generator, position: str) -> str:
    """The region: "in the top left", "in the upper left corner", "top left", "in the middle"."""
    if position == "center":
        word = CENTRE_WORDS[rng.integers(len(CENTRE_WORDS))]
        return f"{'in' if rng.random() < 0.8 else 'at'} the {word}"
    vertical, side = position.split()
    if rng.random() < 0.3:
        vertical = _VERTICAL_SYNONYMS[vertical]
    region = f"{vertical} {side}"
    form = rng.integers(4)
    return (f"in the {region}", f"in the {region} corner", f"at the {region}", region)[form]


def _background(rng: np.random.Generator, colour: str) -> str:
    """The background: "on a blue background", "on blue", ", blue background", "with a blue background"."""
    article = "an" if colour[0] in "aeiou" else "a"
    draw = rng.random()
    if draw < 0.35:
        return f"on {article} {colour} background"
    if draw < 0.6:
        return f"on {colour}"
    if draw < 0.8:
        return f", {colour} background"
    return f"with {article} {colour} background"
