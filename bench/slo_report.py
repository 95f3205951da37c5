"""Service levels of a level's rounds (issue 30): per class, SLO attainment (the share of
requests with a deadline that finished before it; a 429 refusal counts as missed, and is
counted apart), latency and throughput; latency per priority and per tenant; and the
server's preemptions when its /metrics count them.

Latency percentiles pool the rounds' successful requests; throughput is the median over
rounds of each round's finished requests (and outputs) per second of its wall time.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Hashable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from bench.contenders import RoundResult
from bench.drivers import Sample
from bench.report import Cell, LevelResult, WorkloadResult

REFUSED = 429


@dataclass(frozen=True, slots=True)
class Attainment:
    """Requests with a deadline: met (finished in time), refused (429), missed otherwise."""

    deadlines: int = 0
    met: int = 0
    refused: int = 0

    @property
    def share(self) -> float | None:
        return self.met / self.deadlines if self.deadlines else None

    @property
    def late_or_failed(self) -> int:
        return self.deadlines - self.met - self.refused


def attainment(samples: list[Sample]) -> Attainment:
    timed = [s for s in samples if s.deadline_s is not None]
    met = sum(1 for s in timed if s.ok and s.deadline_s is not None and s.latency <= s.deadline_s)
    return Attainment(len(timed), met, sum(1 for s in timed if s.status == REFUSED))


@dataclass(frozen=True, slots=True)
class Group:
    """The figures of one class, priority or tenant of a contender's rounds."""

    requests: int
    ok: int
    attainment: Attainment
    p50_s: float | None
    p99_s: float | None
    requests_per_s: float | None
    outputs_per_s: float | None


def group(rounds: list[RoundResult], chosen: Callable[[Sample], bool]) -> Group:
    samples = [s for r in rounds for s in r.samples if chosen(s)]
    latencies = [s.latency for s in samples if s.ok]
    return Group(
        requests=len(samples),
        ok=len(latencies),
        attainment=attainment(samples),
        p50_s=_percentile(latencies, 50),
        p99_s=_percentile(latencies, 99),
        requests_per_s=_median_rate(rounds, lambda s: 1 if s.ok and chosen(s) else 0),
        outputs_per_s=_median_rate(rounds, lambda s: s.outputs if s.ok and chosen(s) else 0),
    )


def groups_by(cell: Cell, key: Callable[[Sample], Hashable]) -> dict[Any, Group]:
    """`cell`'s figures per value of `key` (in sorted order, None last)."""
    values = {key(s) for r in cell.rounds for s in r.samples}
    ordered = sorted(values, key=lambda v: (v is None, v if isinstance(v, int) else 0, str(v)))
    return {value: group(cell.rounds, _equals(key, value)) for value in ordered}


def _equals(key: Callable[[Sample], Hashable], value: Hashable) -> Callable[[Sample], bool]:
    return lambda sample: key(sample) == value


def has_service_levels(cell: Cell) -> bool:
    """Whether the cell's requests carried any class, priority, tenant or deadline."""
    return any(
        s.klass is not None or s.priority is not None or s.tenant is not None or s.deadline_s is not None
        for r in cell.rounds
        for s in r.samples
    )


def service_levels(cell: Cell) -> dict[str, Any]:
    """The figures as JSON: by class, priority and tenant, and the server's preemptions."""
    if not has_service_levels(cell):
        return {}
    figures = [r.server for r in cell.rounds if r.server is not None]
    preemptions = [f.preemptions for f in figures if f.preemptions is not None]
    peaks = [f.paused_max for f in figures if f.paused_max is not None]
    return {
        "by_class": {str(k): _json(g) for k, g in groups_by(cell, lambda s: s.klass).items()},
        "by_priority": {str(k): _json(g) for k, g in groups_by(cell, lambda s: s.priority).items()},
        "by_tenant": {str(k): _json(g) for k, g in groups_by(cell, lambda s: s.tenant).items()},
        "preemptions": sum(preemptions) if preemptions else None,
        "paused_max": max(peaks) if peaks else None,
    }


def add_service_levels(document: dict[str, Any], results: list[WorkloadResult]) -> None:
    """Each contender's `service_levels` beside its figures in results.json."""
    for entry, result in zip(document["workloads"], results, strict=True):
        for level_entry, level in zip(entry["levels"], result.levels, strict=True):
            for name, cell in level.cells.items():
                if has_service_levels(cell):
                    level_entry["contenders"][name]["service_levels"] = service_levels(cell)


def slo_tables(level: LevelResult, unit: str) -> list[str]:
    """Markdown: by class (SLO attainment, latency, throughput) when requests had classes
    or deadlines, by priority, by tenant, and a line of preemptions per contender; nothing
    when no request carried service levels."""
    cells = {name: cell for name, cell in level.cells.items() if has_service_levels(cell)}
    if not cells:
        return []
    out = ["Service levels (SLO met = finished before the deadline; refused = 429, counted as missed):"]
    if any(s.klass is not None or s.deadline_s is not None for c in cells.values() for s in _all(c)):
        out += ["", *_class_table(cells, unit)]
    for title, key in (("priority", _priority), ("tenant", _tenant)):
        if any(key(s) is not None for c in cells.values() for s in _all(c)):
            out += [
                "",
                f"| contender | {title} | requests | p50 ms | p99 ms | req/s |",
                "|---|---|" + "---:|" * 4,
            ]
            for name, cell in cells.items():
                for value, g in groups_by(cell, key).items():
                    row = [name, "-" if value is None else str(value), str(g.requests)]
                    row += [_ms(g.p50_s), _ms(g.p99_s), _num(g.requests_per_s)]
                    out.append("| " + " | ".join(row) + " |")
    out += ["", *(f"> {line}" for line in [*preemption_lines(cells), *behind_lines(cells)])]
    return out


def _class_table(cells: dict[str, Cell], unit: str) -> list[str]:
    header = "| contender | class | requests | SLO met | refused | late or failed | p50 ms | p99 ms | req/s "
    out = [header + f"| {unit}/s |", "|---|---|" + "---:|" * 8]
    for name, cell in cells.items():
        for klass, g in groups_by(cell, lambda s: s.klass).items():
            a = g.attainment
            share = "-" if a.share is None else f"{a.share * 100:.1f}% ({a.met}/{a.deadlines})"
            late = "-" if a.share is None else str(a.late_or_failed)
            row = [name, klass or "all", str(g.requests), share, str(a.refused), late]
            row += [_ms(g.p50_s), _ms(g.p99_s), _num(g.requests_per_s), _num(g.outputs_per_s)]
            out.append("| " + " | ".join(row) + " |")
    return out


BEHIND = 1.5  # a round that outlasts its arrivals this many times over ran overloaded


def behind_lines(cells: dict[str, Cell]) -> list[str]:
    """A line for each contender whose rounds outlasted their arrivals by far: an open loop
    it could not keep up with measures an overload, not the level asked for."""
    out = []
    for name, cell in cells.items():
        stretch = [
            r.wall_s / span for r in cell.rounds if (span := max((s.sent for s in r.samples), default=0.0))
        ]
        if stretch and max(stretch) > BEHIND:
            out.append(
                f"{name}: rounds lasted {min(stretch):.1f}-{max(stretch):.1f}x their arrivals' span: the "
                "server fell behind the offered rate, so this is an overload rather than the level asked for"
            )
    return out


def preemption_lines(cells: dict[str, Cell]) -> list[str]:
    out = []
    for name, cell in cells.items():
        figures = service_levels(cell)
        if figures["preemptions"] is None:
            out.append(f"{name}: the server's /metrics count no preemptions (none reported)")
            continue
        line = f"{name}: {figures['preemptions']} preemptions"
        if figures["paused_max"] is not None:
            line += f", at most {figures['paused_max']:.0f} requests paused at once"
        out.append(line)
    return out


def _all(cell: Cell) -> list[Sample]:
    return [s for r in cell.rounds for s in r.samples]


def _priority(sample: Sample) -> int | None:
    return sample.priority


def _tenant(sample: Sample) -> int | None:
    return sample.tenant


def _json(g: Group) -> dict[str, Any]:
    out = asdict(g)
    out["attainment"] = {**asdict(g.attainment), "share": g.attainment.share}
    return out


def _percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def _median_rate(rounds: list[RoundResult], count: Callable[[Sample], int]) -> float | None:
    rates = [sum(count(s) for s in r.samples) / r.wall_s for r in rounds if r.wall_s > 0]
    return statistics.median(rates) if rates else None


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"
