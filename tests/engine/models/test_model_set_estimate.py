"""A model's size estimated from its files before its first load (`ModelSlot.estimate`):
the first load makes room ahead, so the models resident never exceed the budget."""

from __future__ import annotations

from typing import Any

from engine.models.model_set import ModelSet
from tests.engine.models.test_model_set import FakeEngine, MiB, Models, engine_of, run


def test_an_estimated_size_makes_room_before_the_first_load() -> None:
    async def scenario() -> None:
        models = Models({"a": 6 * MiB, "b": 6 * MiB})
        slots = models.slots()
        slots[1].estimate = lambda: 6 * MiB
        group = ModelSet(slots, budget_bytes=10 * MiB)
        await engine_of(group, "a")
        states_at_b_start: list[str] = []
        make = group.slots["b"].make

        def watched() -> Any:
            engine: FakeEngine = make()  # type: ignore[assignment]
            real_start = engine.start

            async def start() -> None:
                states_at_b_start.append(group.slots["a"].state)
                await real_start()

            engine.start = start  # type: ignore[method-assign]
            return engine

        group.slots["b"].make = watched
        await engine_of(group, "b")
        assert states_at_b_start == ["unloaded"]  # a went before b began to load
        assert group.residency.used == 6 * MiB

    run(scenario())


def test_a_failed_or_unknown_estimate_loads_as_before() -> None:
    async def scenario() -> None:
        models = Models({"a": 6 * MiB, "b": 6 * MiB})
        slots = models.slots()

        def broken() -> int | None:
            raise OSError("unreadable")

        slots[0].estimate = broken
        slots[1].estimate = lambda: None
        group = ModelSet(slots, budget_bytes=10 * MiB)
        await engine_of(group, "a")
        await engine_of(group, "b")  # unknown: loads, then the idle a is trimmed
        assert group.slots["b"].state == "loaded"

    run(scenario())
