"""`ModelSet`: one engine per model, loaded on first use, unloaded by memory — never while it
works — and a failed load failing only its own model. Fake engines, no torch."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest

from engine.errors import ModelUnavailableError
from engine.models.model_set import ModelSet, ModelSlot
from tests.polling import until

MiB = 2**20


class FakeEngine:
    """What `ModelSet` reads of an engine: start/stop, work in hand, weights' bytes, counters."""

    def __init__(self, name: str, weight_bytes: int, fail: str | None = None) -> None:
        self.name = name
        self.weight_bytes = weight_bytes
        self.fail = fail
        self.observers: list[Any] = []
        self.num_waiting = 0
        self.num_running = 0
        self.paused = 0  # requests paused for better-priority work: neither waiting nor running
        self.modality = "image"
        self.lanes: list[Any] = []
        # The counters a model set keeps when the engine unloads.
        self.out_of_memory_in_halves: dict[str, int] = {}
        self.prompt_cache: dict[str, float] = {}
        self.answers_by_replica: dict[str, int] = {}
        self.started = self.stopped = False
        self.release = asyncio.Event()
        self.release.set()

    @property
    def num_unfinished(self) -> int:
        return self.num_waiting + self.num_running + self.paused

    async def start(self) -> None:
        await self.release.wait()
        if self.fail is not None:
            raise RuntimeError(self.fail)
        self.started = True

    async def stop(self) -> None:
        self.stopped = True


class Models:
    """Makes each model's engine on demand, recording every engine made."""

    def __init__(self, sizes: dict[str, int], fail: dict[str, str] | None = None) -> None:
        self.sizes = sizes
        self.fail = fail or {}
        self.made: list[FakeEngine] = []

    def slots(self, preload: tuple[str, ...] = ()) -> list[ModelSlot]:
        return [ModelSlot(name, self._maker(name), preload=name in preload) for name in self.sizes]

    def _maker(self, name: str) -> Any:
        def make() -> FakeEngine:
            engine = FakeEngine(name, self.sizes[name], self.fail.get(name))
            self.made.append(engine)
            return engine

        return make


async def engine_of(group: ModelSet, name: str | None, timeout_s: float | None = None) -> FakeEngine:
    """The fake engine itself; its claim is dropped at once (as by a route that refused)."""
    claimed = await group.engine_for(name, timeout_s)
    return cast(FakeEngine, claimed._engine)  # type: ignore[attr-defined]


def state_of(group: ModelSet, name: str) -> str:
    return group.slots[name].state


async def settle() -> None:
    """Let every ready task run to its next wait (no wall clock: the loads here wait on
    state, or poll at 50 ms, and are checked before their first poll)."""
    for _ in range(20):
        await asyncio.sleep(0)


def run(coroutine: Any) -> Any:
    return asyncio.run(coroutine)


def test_loads_on_first_use_once_and_routes_by_name() -> None:
    async def scenario() -> None:
        models = Models({"a": MiB, "b": MiB})
        group = ModelSet(models.slots())
        await group.start()
        assert models.made == []  # nothing preloaded
        a1, a2 = await asyncio.gather(engine_of(group, "a"), engine_of(group, None))  # None: the first
        assert a1 is a2 and len(models.made) == 1 and a1.name == "a"
        b = await engine_of(group, "b")
        assert b.name == "b" and group.slots["b"].state == "loaded"
        assert group.residency.used == 2 * MiB

    run(scenario())


def test_preload_at_start() -> None:
    async def scenario() -> None:
        models = Models({"a": MiB, "b": MiB})
        group = ModelSet(models.slots(preload=("b",)))
        await group.start()
        assert [e.name for e in models.made] == ["b"] and group.slots["b"].state == "loaded"

    run(scenario())


def test_a_budget_for_two_of_three_unloads_the_least_recently_used_idle() -> None:
    async def scenario() -> None:
        models = Models({"a": 4 * MiB, "b": 4 * MiB, "c": 4 * MiB})
        group = ModelSet(models.slots(), budget_bytes=10 * MiB)
        for name in ("a", "b", "c", "a", "b", "c"):
            await engine_of(group, name)
            assert group.residency.used <= 10 * MiB
        # Round robin over three with room for two: every switch after the first two loads.
        assert [group.slots[n].loads for n in "abc"] == [2, 2, 2]
        assert sum(group.slots[n].evictions for n in "abc") == 4
        assert all(e.stopped for e in models.made[:4])

    run(scenario())


@pytest.mark.parametrize("work", ["num_running", "paused"])
def test_a_busy_model_is_never_unloaded_the_load_waits_for_it(work: str) -> None:
    """Busy: running, or holding a request paused for better-priority work (its state needs
    the weights where they are), which neither the waiting nor the running count shows."""

    async def scenario() -> None:
        models = Models({"a": 6 * MiB, "b": 6 * MiB})
        group = ModelSet(models.slots(), budget_bytes=10 * MiB)
        a = await engine_of(group, "a")
        await engine_of(group, "b")  # a was idle: unloaded
        a = await engine_of(group, "a")  # b idle: unloaded, a back
        setattr(a, work, 1)  # a works now
        waiting = asyncio.create_task(engine_of(group, "b"))
        await until(lambda: group.draining == {"a"}, "b's load waits for a to finish")
        assert not waiting.done() and state_of(group, "a") == "loaded"  # b waits for room
        setattr(a, work, 0)
        b = await asyncio.wait_for(waiting, 5)
        assert b.name == "b" and state_of(group, "a") == "unloaded"

    run(scenario())


def test_a_model_under_steady_load_drains_so_the_other_gets_its_turn() -> None:
    async def scenario() -> None:
        models = Models({"a": 6 * MiB, "b": 6 * MiB})
        group = ModelSet(models.slots(), budget_bytes=10 * MiB)
        await engine_of(group, "b")
        first_a = await engine_of(group, "a")
        first_a.num_running = 1
        b_load = asyncio.create_task(engine_of(group, "b"))
        await until(lambda: group.draining == {"a"}, "a drains for b")
        # A new request for a does not join the draining engine: it waits for its turn.
        a_again = asyncio.create_task(engine_of(group, "a"))
        await until(lambda: group.slots["a"].waiting == 1, "the new request for a waits")
        assert not a_again.done() and not b_load.done()
        first_a.num_running = 0
        assert (await asyncio.wait_for(b_load, 5)).name == "b"
        second_a = await asyncio.wait_for(a_again, 5)  # b idle: unloaded for a's turn
        assert second_a is not first_a and first_a.stopped and state_of(group, "b") == "unloaded"

    run(scenario())


def test_a_busy_model_keeps_its_turn_as_long_as_its_load_took() -> None:
    async def scenario() -> None:
        now = [0.0]
        models = Models({"a": 6 * MiB, "b": 6 * MiB})
        group = ModelSet(models.slots(), budget_bytes=10 * MiB, clock=lambda: now[0])
        for slot in group.slots.values():
            make = slot.make

            def slow(make: Any = make) -> FakeEngine:
                engine = make()
                real_start = engine.start

                async def start() -> None:
                    now[0] += 5.0  # a load takes 5 s
                    await real_start()

                engine.start = start
                return cast(FakeEngine, engine)

            slot.make = cast(Any, slow)
        await engine_of(group, "b")  # b's size is known
        a = await engine_of(group, "a")  # loaded at t=10, in 5 s
        a.num_running = 1
        now[0] = 12.0
        b_load = asyncio.create_task(engine_of(group, "b"))
        await until(lambda: group.slots["b"].waiting == 1 and group._lock.locked(), "b's load began")
        await settle()
        assert group.draining == set() and (await engine_of(group, "a")) is a  # a's turn goes on
        now[0] = 15.5
        await until(lambda: group.draining == {"a"}, "a's turn is over: it drains")
        a.num_running = 0
        assert (await asyncio.wait_for(b_load, 5)).name == "b"

    run(scenario())


def test_an_engine_handed_to_a_request_is_not_unloaded_before_the_request_is_submitted() -> None:
    async def scenario() -> None:
        models = Models({"a": 6 * MiB, "b": 6 * MiB})
        group = ModelSet(models.slots(), budget_bytes=10 * MiB)
        await engine_of(group, "b")  # b's size is known from now on
        claimed = await group.engine_for("a")  # a route holding it, reading an upload
        assert group.slots["a"].busy
        b_load = asyncio.create_task(engine_of(group, "b"))
        await until(lambda: group.slots["b"].waiting == 1 and group._lock.locked(), "b's load began")
        await settle()
        assert not b_load.done() and state_of(group, "a") == "loaded"
        with pytest.raises(AttributeError):  # the fake has no submit: refused, claim released
            claimed.submit(object())  # type: ignore[arg-type]
        assert not group.slots["a"].busy
        assert (await asyncio.wait_for(b_load, 5)).name == "b"

    run(scenario())


def test_a_dropped_claim_is_released() -> None:
    async def scenario() -> None:
        group = ModelSet(Models({"a": MiB}).slots())
        claimed = await group.engine_for("a")
        assert group.slots["a"].claims == 1
        del claimed
        assert group.slots["a"].claims == 0

    run(scenario())


def test_models_over_budget_after_an_unknown_size_load_are_trimmed_once_idle() -> None:
    async def scenario() -> None:
        models = Models({"a": 6 * MiB, "b": 6 * MiB})
        group = ModelSet(models.slots(), budget_bytes=10 * MiB)
        a = await engine_of(group, "a")
        a.num_running = 1
        await engine_of(group, "b")  # size unknown: loads beside the busy a, over the budget
        assert group.residency.used == 12 * MiB
        a.num_running = 0
        await engine_of(group, "b")  # over budget: idle models other than b go
        await until(lambda: state_of(group, "a") == "unloaded", "a trimmed")
        assert group.residency.used == 6 * MiB

    run(scenario())


def test_a_request_arriving_while_one_victim_stops_is_not_handed_another_victim() -> None:
    """Victims are detached before any of them stops: while the first stops (slowly), a
    request for the second loads it anew instead of getting an engine about to be stopped."""

    async def scenario() -> None:
        models = Models({"a": 4 * MiB, "b": 4 * MiB, "c": 8 * MiB})
        group = ModelSet(models.slots(), budget_bytes=8 * MiB)
        await engine_of(group, "c")  # c's size is known
        a = await engine_of(group, "a")
        b = await engine_of(group, "b")
        release = asyncio.Event()
        real_stop = a.stop

        async def slow_stop() -> None:
            await release.wait()
            await real_stop()

        a.stop = slow_stop  # type: ignore[method-assign]
        c_load = asyncio.create_task(engine_of(group, "c"))  # unloads a and b
        await until(lambda: b.stopped, "b stopped while a stops slowly")
        assert state_of(group, "b") == "unloaded"
        b_again = asyncio.create_task(engine_of(group, "b"))
        release.set()
        await asyncio.wait_for(c_load, 5)
        assert (await asyncio.wait_for(b_again, 5)) is not b  # a fresh engine, never the stopped one

    run(scenario())


def test_a_load_waiting_past_its_deadline_is_unavailable() -> None:
    async def scenario() -> None:
        models = Models({"a": 6 * MiB, "b": 6 * MiB})
        group = ModelSet(models.slots(), budget_bytes=10 * MiB)
        a = await engine_of(group, "a")
        await engine_of(group, "b")
        a = await engine_of(group, "a")
        a.num_waiting = 1
        with pytest.raises(ModelUnavailableError, match="in time") as caught:
            await engine_of(group, "b", timeout_s=0.2)
        assert caught.value.retry
        a.num_waiting = 0  # the load it began goes on, and lands
        assert (await engine_of(group, "b", timeout_s=5)).name == "b"

    run(scenario())


def test_a_failed_load_fails_only_its_model_and_is_retried_later() -> None:
    async def scenario() -> None:
        now = [0.0]
        models = Models({"good": MiB, "broken": MiB}, fail={"broken": "no model_index.json in /x"})
        group = ModelSet(models.slots(), retry_failed_s=60, clock=lambda: now[0])
        with pytest.raises(ModelUnavailableError, match=r"no model_index\.json") as caught:
            await engine_of(group, "broken")
        assert not caught.value.retry and group.slots["broken"].state == "failed"
        assert (await engine_of(group, "good")).name == "good"
        made = len(models.made)
        with pytest.raises(ModelUnavailableError, match=r"no model_index\.json"):
            await engine_of(group, "broken")  # not tried again so soon
        assert len(models.made) == made
        now[0] = 61.0
        models.fail.clear()  # fixed meanwhile
        assert (await engine_of(group, "broken")).name == "broken"
        assert group.slots["broken"].load_failures == 1

    run(scenario())


def test_stop_stops_every_loaded_engine() -> None:
    async def scenario() -> None:
        models = Models({"a": MiB, "b": MiB})
        group = ModelSet(models.slots(preload=("a", "b")))
        await group.start()
        await group.stop()
        assert all(e.stopped for e in models.made) and group.loaded_engines() == []

    run(scenario())
