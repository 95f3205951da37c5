"""Deadlines as multiples of a request's alone time (`deadline=2x`): how long each request
shape takes with the server otherwise idle, measured in the same run on the reference
server, and the trace's deadlines resolved into seconds from it."""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import replace

from bench.contenders import Load, ServerContender
from bench.workload import PROMPTS, RequestSpec

ALONE_REPEATS = 3  # lone requests per shape; the median is its alone time


def alone_shape(spec: RequestSpec) -> RequestSpec:
    """What a request's alone time depends on: the spec without its prompt text, seed, or
    service-level fields (one prompt stands for all: encoding is a small share of a request)."""
    return replace(
        spec,
        prompt=PROMPTS[1],
        seed=0,
        priority=None,
        deadline=None,
        deadline_s=None,
        tenant=None,
        klass=None,
    )


def shapes_needing_alone_times(
    specs: Iterable[RequestSpec], known: Iterable[RequestSpec]
) -> set[RequestSpec]:
    have = set(known)
    return {alone_shape(s) for s in specs if s.deadline is not None and s.deadline.relative} - have


async def measure_alone_times(
    server: ServerContender, shapes: Iterable[RequestSpec], repeats: int = ALONE_REPEATS
) -> dict[RequestSpec, float]:
    """Each shape's median latency over `repeats` requests sent one at a time."""
    times = {}
    for shape in sorted(shapes, key=repr):
        result = await server.run(Load("closed", 1), [shape] * repeats)
        latencies = [s.latency for s in result.samples if s.ok]
        if not latencies:
            error = next((s.error for s in result.samples if s.error), "no answer")
            raise RuntimeError(f"measuring the alone time of {shape} on {server.name} failed: {error}")
        times[shape] = statistics.median(latencies)
    return times


def resolve_deadlines(specs: list[RequestSpec], alone: dict[RequestSpec, float]) -> list[RequestSpec]:
    """The specs with `deadline_s` set: seconds as written, or N times their shape's alone time."""
    out = []
    for spec in specs:
        deadline = spec.deadline
        if deadline is None:
            out.append(spec)
            continue
        seconds = deadline.value * alone[alone_shape(spec)] if deadline.relative else deadline.value
        out.append(replace(spec, deadline_s=seconds))
    return out


def describe_shape(shape: RequestSpec) -> str:
    """A shape's label in the report: what varies between the shapes of a mix."""
    size = "auto" if shape.width is None else f"{shape.width}x{shape.height}"
    label = f"steps={'default' if shape.steps is None else shape.steps} size={size} n={shape.n}"
    return label + (f" model={shape.model}" if shape.model else "")
