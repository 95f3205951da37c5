"""`ModelSet` with a host budget: the least recently used idle model is parked in host
memory (its engine up, its weights moved) instead of dropped, and comes back on its next
request without a load; a model that cannot move (offload, quantized weights, a worker
process) or does not fit the host budget is dropped. Fake engines and executors, no torch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.models.model_set import ModelSet
from tests.engine.models.test_model_set import FakeEngine, MiB, Models, engine_of, run


@dataclass
class MovableExecutor:
    """Where its weights are, and why they could not move (None: they can)."""

    blocker: str | None = None
    where: str = "device"
    moves: list[str] = field(default_factory=list)

    async def park_blocker(self) -> str | None:
        return self.blocker

    async def move_weights(self, to_host: bool) -> None:
        self.where = "host" if to_host else "device"
        self.moves.append(self.where)


@dataclass
class Lane:
    executor: Any
    model: str | None = None
    label: str = "0"
    busy_s: float = 0.0
    units: int = 0
    steps: Any = None  # request mode: no step scheduler


class HostModels(Models):
    def __init__(self, sizes: dict[str, int], blockers: dict[str, str] | None = None) -> None:
        super().__init__(sizes)
        self.blockers = blockers or {}

    def _maker(self, name: str) -> Any:
        def make() -> FakeEngine:
            engine = FakeEngine(name, self.sizes[name])
            engine.lanes = [Lane(MovableExecutor(self.blockers.get(name)))]
            self.made.append(engine)
            return engine

        return make


def where(engine: FakeEngine) -> str:
    return str(engine.lanes[0].executor.where)


def test_an_idle_model_is_parked_on_the_host_and_comes_back_without_a_load() -> None:
    async def scenario() -> None:
        models = HostModels({"a": 6 * MiB, "b": 6 * MiB})
        group = ModelSet(models.slots(), budget_bytes=10 * MiB, host_budget_bytes=10 * MiB)
        a = await engine_of(group, "a")
        b = await engine_of(group, "b")  # a goes to the host
        assert group.slots["a"].state == "parked" and where(a) == "host" and not a.stopped
        assert group.residency.used == 6 * MiB and group.residency.host_used == 6 * MiB
        again = await engine_of(group, "a")  # back from the host; b parked in its place
        assert again is a and where(a) == "device" and len(models.made) == 2
        assert group.slots["a"].loads == 1 and group.slots["a"].unparks == 1
        assert group.slots["b"].state == "parked" and where(b) == "host"
        assert group.slots["a"].evictions == 1 and group.slots["b"].parks == 1

    run(scenario())


def test_a_model_that_cannot_move_or_fit_the_host_is_dropped() -> None:
    async def scenario() -> None:
        models = HostModels(
            {"q": 6 * MiB, "big": 12 * MiB, "b": 6 * MiB}, blockers={"q": "its weights are quantized"}
        )
        group = ModelSet(models.slots(), budget_bytes=12 * MiB, host_budget_bytes=10 * MiB)
        q = await engine_of(group, "q")
        big = await engine_of(group, "big")  # q cannot move: dropped
        assert group.slots["q"].state == "unloaded" and q.stopped and q.lanes[0].executor.moves == []
        await engine_of(group, "b")  # big is over the host budget: dropped
        assert group.slots["big"].state == "unloaded" and big.stopped
        assert group.residency.host_used == 0

    run(scenario())


def test_parking_another_drops_the_least_recently_parked() -> None:
    async def scenario() -> None:
        models = HostModels({"a": 6 * MiB, "b": 6 * MiB, "c": 6 * MiB})
        group = ModelSet(models.slots(), budget_bytes=6 * MiB, host_budget_bytes=6 * MiB)
        a = await engine_of(group, "a")
        await engine_of(group, "b")  # a parked
        await engine_of(group, "c")  # b parked, a dropped from the host
        assert [group.slots[n].state for n in "abc"] == ["unloaded", "parked", "loaded"]
        assert a.stopped and group.residency.host_used == 6 * MiB

    run(scenario())


def test_without_a_host_budget_models_are_dropped_as_before() -> None:
    async def scenario() -> None:
        models = HostModels({"a": 6 * MiB, "b": 6 * MiB})
        group = ModelSet(models.slots(), budget_bytes=10 * MiB)
        a = await engine_of(group, "a")
        await engine_of(group, "b")
        assert group.slots["a"].state == "unloaded" and a.stopped and where(a) == "device"

    run(scenario())
