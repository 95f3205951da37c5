"""What the benchmark sends: request mixes drawn from a seeded generator, and workloads.

Pure: no I/O, no clock. A `Mix` lists the choices for each parameter; every request draws
each one independently, so `steps=4,8,16,32` gives a mixed-steps trace and single values
give identical requests. The same seed always gives the same requests and arrival times,
so two runs (and every contender within a run) see exactly the same trace.

Service levels (issue 30): a mix may hold request classes (`class=NAME`, each with its own
options and a `share` of the arrivals) and tenants (`tenants=K rates=10:1`), and requests
may carry a `priority` and a `deadline` (seconds, or `Nx` times their alone time); the
grammar of those tokens lives in `bench.service_levels`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from bench.mix_options import OPTIONS, Deadline

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
    priority: int | None = None  # the `priority` field; None = not sent (the key's default)
    deadline: Deadline | None = None  # as drawn; the runner resolves it into `deadline_s`
    deadline_s: float | None = None  # seconds from sending within which it should finish
    tenant: int | None = None  # 1-based: which tenant's API key sends it
    klass: str | None = None  # the request class (`class=NAME`) it was drawn from
    controlnet: str | None = None  # the ControlNet it names, with a control image; None: none


@dataclass(frozen=True, slots=True)
class RequestClass:
    """One class of a class mix: its name, its relative share of the requests, its options."""

    name: str
    share: float
    mix: Mix


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
    priorities: tuple[int | None, ...] = (None,)
    deadlines: tuple[Deadline | None, ...] = (None,)
    classes: tuple[RequestClass, ...] = ()  # a class mix: each request draws its class first
    tenant_rates: tuple[float, ...] = ()  # relative rates; each request draws its tenant
    controlnets: tuple[str | None, ...] = (None,)

    def draw(self, count: int, rng: random.Random) -> list[RequestSpec]:
        # Classes and tenants are drawn only when asked for, so other traces stay as they were.
        specs = [self._draw_class(rng) if self.classes else self._draw_one(rng) for _ in range(count)]
        if self.tenant_rates:
            tenants = range(1, len(self.tenant_rates) + 1)
            specs = [replace(s, tenant=rng.choices(tenants, self.tenant_rates)[0]) for s in specs]
        return specs

    def _draw_class(self, rng: random.Random) -> RequestSpec:
        chosen = rng.choices(self.classes, [c.share for c in self.classes])[0]
        return replace(chosen.mix._draw_one(rng), klass=chosen.name)

    def _draw_one(self, rng: random.Random) -> RequestSpec:
        width, height = rng.choice(self.sizes) or (None, None)
        return RequestSpec(
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
            priority=rng.choice(self.priorities) if self.priorities != (None,) else None,
            deadline=rng.choice(self.deadlines) if self.deadlines != (None,) else None,
            controlnet=rng.choice(self.controlnets) if self.controlnets != (None,) else None,
        )

    def with_seconds(self, seconds: float | None) -> Mix:
        """The mix (and each of its classes) asking for videos `seconds` long."""
        classes = tuple(replace(c, mix=c.mix.with_seconds(seconds)) for c in self.classes)
        return replace(self, seconds=seconds, classes=classes)

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
        if self.priorities != (None,):
            parts.append("priority=" + ",".join("default" if p is None else str(p) for p in self.priorities))
        if self.deadlines != (None,):
            parts.append(
                "deadline=" + ",".join("none" if d is None else d.describe() for d in self.deadlines)
            )
        if self.controlnets != (None,):
            parts.append("controlnet=" + ",".join("none" if c is None else c for c in self.controlnets))
        if self.stream:
            parts.append("stream")
        if self.seconds is not None:
            parts.append(f"seconds={self.seconds:g}")
        if self.tenant_rates:
            rates = ":".join(f"{r:g}" for r in self.tenant_rates)
            parts.append(f"tenants={len(self.tenant_rates)} rates={rates}")
        if self.classes:  # each class whole, as it draws
            parts = [p for p in parts if p.startswith(("tenants=", "rates="))]
            parts += [f"class={c.name} share={c.share:g} ({c.mix.describe()})" for c in self.classes]
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
    model, priority, deadline, controlnet) override the run's mix; `class=`, `share=`, `tenants=` and
    `rates=` make class mixes and tenants (`_mix_of`), e.g.
    `poisson:80% class=interactive share=3 steps=4,8 priority=0 deadline=2x class=batch steps=32
    priority=10` or `poisson:80% tenants=2 rates=10:1`."""
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
    return Workload(kind, levels, _mix_of(options, default_mix, text), text)  # type: ignore[arg-type]


def _mix_of(options: list[str], base: Mix, text: str) -> Mix:
    """The workload's mix. Options before any `class=` apply to every request; `class=NAME`
    starts a class of requests (the options so far, then its own, which follow it, and
    `share=W`: its weight among the classes, default 1); `tenants=K` and `rates=A:B:...`
    spread the requests over K API keys at those relative rates (default equal)."""
    classes: list[RequestClass] = []
    tenants = 0
    rates: tuple[float, ...] = ()
    for option in options:
        key, sep, value = option.partition("=")
        if not sep:
            raise ValueError(f"workload {text!r}: options look like key=value, got {option!r}")
        if key == "class":
            if not value or value in [c.name for c in classes]:
                raise ValueError(f"workload {text!r}: each class needs a name of its own, got {value!r}")
            classes.append(RequestClass(value, 1.0, base))
        elif key == "share":
            if not classes:
                raise ValueError(f"workload {text!r}: share= follows the class=NAME it weighs")
            classes[-1] = replace(classes[-1], share=_positive(key, value, text))
        elif key == "tenants":
            tenants = int(value) if value.isdigit() else 0
            if tenants < 1:
                raise ValueError(f"workload {text!r}: tenants must be a positive integer, got {value!r}")
        elif key == "rates":
            rates = tuple(_positive(key, item, text) for item in value.split(":"))
        elif classes:
            classes[-1] = replace(classes[-1], mix=with_option(classes[-1].mix, key, value))
        else:
            base = with_option(base, key, value)
    if rates and len(rates) != tenants:
        raise ValueError(f"workload {text!r}: rates= gives one rate per tenant (tenants={tenants})")
    return replace(base, classes=tuple(classes), tenant_rates=rates or (1.0,) * tenants)


def _positive(key: str, value: str, text: str) -> float:
    try:
        number = float(value)
    except ValueError:
        number = 0.0
    if not 0 < number < float("inf"):
        raise ValueError(f"workload {text!r}: {key} must be a positive number, got {value!r}")
    return number


def with_option(mix: Mix, key: str, value: str) -> Mix:
    """`mix` with one parameter's choices replaced, from their command-line spelling."""
    items = [item for item in value.split(",") if item]
    if not items:
        raise ValueError(f"{key} needs at least one value")
    if key not in OPTIONS:
        raise ValueError(f"unknown mix option {key!r}: use {', '.join(OPTIONS)}")
    field_name, parse = OPTIONS[key]
    changes: dict[str, Any] = {field_name: tuple(parse(key, item) for item in items)}
    return replace(mix, **changes)


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
