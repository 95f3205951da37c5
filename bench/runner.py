"""Running a benchmark plan: warm-up, capacity, and each workload level round by round.

Every round draws one trace from a seeded generator and gives it to every contender in
turn (the order rotating each round), so the machine's noise hits them alike.
"""

from __future__ import annotations

import argparse
import random
from typing import Any

from tqdm import tqdm

from bench.alone_times import (
    describe_shape,
    measure_alone_times,
    resolve_deadlines,
    shapes_needing_alone_times,
)
from bench.arms import server_of
from bench.contenders import Contender, Load, ServerContender
from bench.report import Cell, LevelResult, WorkloadResult
from bench.workload import Level, Mix, RequestSpec, Workload, poisson_arrivals


class Runner:
    """Runs every level of a workload, contenders interleaved round by round."""

    def __init__(self, contenders: list[Contender], args: argparse.Namespace, bar: tqdm[Any]) -> None:
        self.contenders = contenders
        self.args = args
        self.bar = bar
        self.capacity: dict[Mix, float] = {}
        self.alone: dict[RequestSpec, float] = {}  # alone time of each request shape (`deadline=2x`)

    def _advance(self, count: int, text: str) -> None:
        self.bar.set_description(text)
        self.bar.update(count)

    async def warm_up(self, mix: Mix) -> None:
        specs = mix.draw(self.args.warmup, random.Random(-1))
        warmed: list[object] = []
        for contender in self.contenders:
            # Arms share their server: it warms up once (the others' share is skipped).
            server = server_of(contender) or contender
            if not any(server is other for other in warmed):
                await contender.run(Load("closed", self.args.max_num_seqs), specs)
                warmed.append(server)
            self._advance(len(specs), f"warm-up {contender.name}")

    async def workload(self, index: int, workload: Workload) -> WorkloadResult:
        result = WorkloadResult(workload)
        for j, level in enumerate(workload.levels):
            value = await self._level_value(workload, level)
            cells = {c.name: Cell(c.name) for c in self.contenders}
            for r in range(self.args.rounds):
                # The same trace for every contender of this round; a new one each round.
                rng = random.Random(f"{self.args.seed}/{index}/{j}/{r}")
                specs = await self._with_deadlines(workload.mix.draw(self.args.requests, rng))
                poisson = workload.kind == "poisson"
                load = Load(
                    workload.kind, value, tuple(poisson_arrivals(len(specs), value, rng)) if poisson else ()
                )
                turn = r % len(self.contenders)  # rotate, so no contender always runs first
                for contender in self.contenders[turn:] + self.contenders[:turn]:
                    cells[contender.name].rounds.append(await contender.run(load, specs))
                    self._advance(len(specs), f"{workload.spec} {level.label()} #{r + 1} {contender.name}")
            result.levels.append(LevelResult(level.label(), value, cells))
        return result

    async def _level_value(self, workload: Workload, level: Level) -> float:
        if not level.fraction:
            return level.value
        if workload.mix not in self.capacity:
            self.capacity[workload.mix] = await self._measure_capacity(workload.mix)
        return level.value * self.capacity[workload.mix]

    def _reference(self, needs: str) -> ServerContender:
        """The server that measures capacity and alone times: `server`, else the first one."""
        servers = [server for c in self.contenders if (server := server_of(c)) is not None]
        if not servers:
            raise ValueError(f"{needs} needs a server contender to measure it")
        return next((c for c in servers if c.name == "server"), servers[0])

    def alone_times_ms(self) -> dict[str, float]:
        """The alone times measured for `deadline=Nx`, by shape, in milliseconds."""
        return {describe_shape(shape): seconds * 1000 for shape, seconds in self.alone.items()}

    async def _with_deadlines(self, specs: list[RequestSpec]) -> list[RequestSpec]:
        """The specs with their deadlines in seconds, measuring the alone times still unknown."""
        shapes = shapes_needing_alone_times(specs, self.alone)
        if shapes:
            reference = self._reference("a deadline given as a multiple of the alone time (2x)")
            measured = await measure_alone_times(reference, shapes)
            for shape, seconds in measured.items():
                self.bar.write(
                    f"alone time on {reference.name} ({describe_shape(shape)}): {seconds * 1000:.0f} ms"
                )
            self.alone |= measured
        return resolve_deadlines(specs, self.alone)

    async def _measure_capacity(self, mix: Mix) -> float:
        """Requests/s of the reference server (`server`, else the first one) in a saturated closed loop."""
        reference = self._reference("a rate given as % of capacity")
        clients = self.args.capacity_concurrency or 2 * self.args.max_num_seqs
        specs = mix.draw(self.args.requests, random.Random(f"{self.args.seed}/capacity"))
        result = await reference.run(Load("closed", clients), specs)
        capacity = sum(1 for s in result.samples if s.ok) / result.wall_s
        self.bar.write(f"capacity of {reference.name} ({mix.describe()}): {capacity:.2f} requests/s")
        return capacity
