"""What the benchmark sends: request mixes drawn from a seeded generator, and workloads.

Pure: no I/O, no clock. A `Mix` lists the choices for each parameter; every request draws
each one independently, so `steps=4,8,16,32` gives a mixed-steps trace and single values
give identical requests. The same seed always gives the same requests and arrival times,
so two runs (and every contender within a run) see exactly the same trace.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Literal

WorkloadKind = Literal["closed", "poisson", "lone", "burst"]

# Prompts of very different lengths, so text encoding and padding are exercised as in life.
PROMPTS = (
    "a cat",
    "an astronaut riding a horse on the moon",
    "a watercolor painting of a mountain lake at dawn, mist over the water",
    "portrait of an old man with a beard, highly detailed, studio lighting, 85mm",
    "a bowl of fruit on a wooden table",
    "city street at night with neon signs reflected in puddles after the rain, cinematic",
    "a dog running through a field of flowers",
    "a castle on a hill under a starry sky, oil painting in the style of the romantics",
)
_SIZE = re.compile(r"^(\d+)x(\d+)$")


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request of a trace, in wire terms (`steps` and `guidance` None = the model's default)."""

    prompt: str
    width: int | None  # None: the model's default size (size=auto)
    height: int | None
    steps: int | None
    guidance: float | None
    n: int
    seed: int
    stream: bool = False
    seconds: float | None = None  # video models only
    negative_prompt: str | None = None
    partial_images: int = 0  # previews; a request that asks for them is streamed
    strength: float | None = None  # image-to-image models only; None = the model's default
    model: str | None = None  # a server of several models: which one; None = its default


@dataclass(frozen=True, slots=True)
class Mix:
    sizes: tuple[tuple[int, int] | None, ...] = (None,)
    steps: tuple[int | None, ...] = (4,)
    guidance: tuple[float | None, ...] = (None,)
    n: tuple[int, ...] = (1,)
    negative: tuple[str | None, ...] = (None,)
    stream: bool = False
    seconds: float | None = None
    partials: tuple[int, ...] = (0,)
    strength: tuple[float | None, ...] = (None,)
    models: tuple[str | None, ...] = (None,)

    def draw(self, count: int, rng: random.Random) -> list[RequestSpec]:
        specs = []
        for _ in range(count):
            width, height = rng.choice(self.sizes) or (None, None)
            specs.append(
                RequestSpec(
                    prompt=rng.choice(PROMPTS),
                    width=width,
                    height=height,
                    steps=rng.choice(self.steps),
                    guidance=rng.choice(self.guidance),
                    n=rng.choice(self.n),
                    seed=rng.randrange(2**31),
                    stream=self.stream,
                    seconds=self.seconds,
                    negative_prompt=rng.choice(self.negative),
                    partial_images=rng.choice(self.partials),
                    # Drawn only when asked for, so that traces without it stay as they were.
                    strength=rng.choice(self.strength) if self.strength != (None,) else None,
                    model=rng.choice(self.models) if self.models != (None,) else None,
                )
            )
        return specs

    def describe(self) -> str:
        parts = [
            "size=" + ",".join("auto" if s is None else f"{s[0]}x{s[1]}" for s in self.sizes),
            "steps=" + ",".join("default" if v is None else str(v) for v in self.steps),
            "guidance=" + ",".join("default" if g is None else f"{g:g}" for g in self.guidance),
            "n=" + ",".join(map(str, self.n)),
        ]
        if self.negative != (None,):
            parts.append("negative=" + ",".join("none" if t is None else t for t in self.negative))
        if self.partials != (0,):
            parts.append("partials=" + ",".join(map(str, self.partials)))
        if self.strength != (None,):
            parts.append("strength=" + ",".join("default" if v is None else f"{v:g}" for v in self.strength))
        if self.models != (None,):
            parts.append("model=" + ",".join("default" if m is None else m for m in self.models))
        if self.stream:
            parts.append("stream")
        if self.seconds is not None:
            parts.append(f"seconds={self.seconds:g}")
        return " ".join(parts)


@dataclass(frozen=True, slots=True)
class Level:
    """One point of a workload's sweep: a concurrency, a burst size, or an arrival rate.

    A rate is absolute (requests/s) or, with `fraction`, a share of the measured capacity.
    """

    value: float
    fraction: bool = False

    def label(self) -> str:
        return f"{self.value * 100:g}%" if self.fraction else f"{self.value:g}"


@dataclass(frozen=True, slots=True)
class Workload:
    kind: WorkloadKind
    levels: tuple[Level, ...]
    mix: Mix
    spec: str = field(default="", compare=False)  # as the user wrote it

    def axis(self) -> str:
        return {"closed": "concurrency", "poisson": "arrival rate (requests/s)", "lone": "clients"}.get(
            self.kind, "burst size"
        )


def parse_workload(text: str, default_mix: Mix) -> Workload:
    """`KIND[:LEVELS] [key=values ...]`, e.g. `closed:8,16`, `poisson:50%,80% steps=4,8,16,32`,
    `lone`, `burst:8 n=1,2,4`. Keys (size, steps, guidance, n, negative, partials, strength,
    model) override the run's mix."""
    head, *options = text.split()
    kind, _, levels_text = head.partition(":")
    if kind not in ("closed", "poisson", "lone", "burst"):
        raise ValueError(f"workload {text!r}: kind must be closed, poisson, lone or burst, got {kind!r}")
    if kind == "lone":
        if levels_text:
            raise ValueError(f"workload {text!r}: lone takes no levels (it is one client)")
        levels: tuple[Level, ...] = (Level(1),)
    else:
        if not levels_text:
            raise ValueError(f"workload {text!r}: {kind} needs levels, e.g. {kind}:8,16")
        levels = tuple(_level(item, kind, text) for item in levels_text.split(","))
    mix = default_mix
    for option in options:
        key, sep, value = option.partition("=")
        if not sep:
            raise ValueError(f"workload {text!r}: options look like key=value, got {option!r}")
        mix = with_option(mix, key, value)
    return Workload(kind, levels, mix, text)  # type: ignore[arg-type]


def with_option(mix: Mix, key: str, value: str) -> Mix:
    """`mix` with one parameter's choices replaced, from their command-line spelling."""
    items = [item for item in value.split(",") if item]
    if not items:
        raise ValueError(f"{key} needs at least one value")
    if key not in _OPTIONS:
        raise ValueError(f"unknown mix option {key!r}: use {', '.join(_OPTIONS)}")
    field_name, parse = _OPTIONS[key]
    changes: dict[str, Any] = {field_name: tuple(parse(key, item) for item in items)}
    return replace(mix, **changes)


def _strength(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise ValueError(f"strength must be above 0 and at most 1, got {text!r}")
    return value


def _partials(text: str) -> int:
    if text not in ("0", "1", "2", "3"):
        raise ValueError(f"partials must be 0 to 3, got {text!r}")
    return int(text)


def parse_size(text: str) -> tuple[int, int] | None:
    if text == "auto":
        return None
    match = _SIZE.match(text)
    if not match:
        raise ValueError(f"size must look like 64x64 (or auto), got {text!r}")
    return int(match[1]), int(match[2])


def poisson_arrivals(count: int, rate: float, rng: random.Random) -> list[float]:
    """Arrival offsets (seconds from the start) of a Poisson process with `rate` per second."""
    offsets, now = [], 0.0
    for _ in range(count):
        now += rng.expovariate(rate)
        offsets.append(now)
    return offsets


def _level(item: str, kind: str, text: str) -> Level:
    try:
        if item.endswith("%"):
            if kind != "poisson":
                raise ValueError
            return Level(float(item[:-1]) / 100, fraction=True)
        value = float(item)
    except ValueError:
        raise ValueError(f"workload {text!r}: bad level {item!r}") from None
    if value <= 0 or (kind != "poisson" and value != int(value)):
        what = "number" if kind == "poisson" else "integer"
        raise ValueError(f"workload {text!r}: level {item!r} must be a positive {what}")
    return Level(value)


def _positive_int(key: str, item: str) -> int:
    value = int(item)
    if value < 1:
        raise ValueError(f"{key} values must be >= 1, got {item}")
    return value


# Each mix option: the `Mix` field it sets, and how one of its comma-separated values reads.
_OPTIONS: dict[str, tuple[str, Callable[[str, str], Any]]] = {
    "size": ("sizes", lambda _key, item: parse_size(item)),
    # default: each server's own (`--default-steps`), to time what a contender's steps cost.
    "steps": ("steps", lambda key, item: None if item == "default" else _positive_int(key, item)),
    "guidance": ("guidance", lambda _key, item: None if item == "default" else float(item)),
    "n": ("n", _positive_int),
    # Negative prompts (none = without one: no CFG where that switches it off).
    "negative": ("negative", lambda _key, item: None if item == "none" else item),
    # partial_images per request (streamed when above 0).
    "partials": ("partials", lambda _key, item: _partials(item)),
    # Image-to-image: how much of the input is redrawn.
    "strength": ("strength", lambda _key, item: None if item == "default" else _strength(item)),
    # A server of several models: the `model` each request names, drawn per request.
    "model": ("models", lambda _key, item: None if item == "default" else item),
}
