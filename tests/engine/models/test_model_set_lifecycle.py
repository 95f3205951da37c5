"""`ModelSet` as the server's engine: running only once the preloads are done, and
`abort_all` ending the requests that wait for a model to load too. Fake engines, no torch."""

from __future__ import annotations

import asyncio

import pytest

from engine.errors import EngineNotRunningError
from engine.models.model_set import ModelSet
from tests.engine.models.test_model_set import MiB, Models, engine_of, run
from tests.polling import until


def test_running_only_once_the_preloads_are_done_and_until_stopped() -> None:
    async def scenario() -> None:
        models = Models({"a": MiB, "b": MiB})
        group = ModelSet(models.slots(preload=("a",)))
        assert not group.is_running
        await group.start()
        assert group.is_running
        await group.stop()
        assert not group.is_running

    run(scenario())


def test_a_slow_preload_keeps_the_set_starting() -> None:
    async def scenario() -> None:
        models = Models({"a": MiB})
        gate = asyncio.Event()
        group = ModelSet(models.slots(preload=("a",)))
        make = group.slots["a"].make

        def held() -> object:
            engine = make()
            engine.release = gate  # type: ignore[attr-defined]
            return engine

        group.slots["a"].make = held  # type: ignore[assignment]
        starting = asyncio.create_task(group.start())
        await until(lambda: group.slots["a"].state == "loading", "a loads")
        assert not group.is_running
        gate.set()
        await starting
        assert group.is_running

    run(scenario())


def test_abort_all_ends_the_requests_waiting_for_a_load_once_with_its_error() -> None:
    async def scenario() -> None:
        models = Models({"a": MiB})
        gate = asyncio.Event()
        group = ModelSet(models.slots())
        await group.start()
        make = group.slots["a"].make

        def held() -> object:
            engine = make()
            engine.release = gate  # type: ignore[attr-defined]
            return engine

        group.slots["a"].make = held  # type: ignore[assignment]
        waiters = [asyncio.create_task(engine_of(group, "a")) for _ in range(2)]
        await until(lambda: group.slots["a"].waiting == 2, "two requests wait for a's load")
        error = EngineNotRunningError("the server is shutting down")
        assert group.abort_all(error) == 2
        for waiter in waiters:
            with pytest.raises(EngineNotRunningError, match="shutting down"):
                await waiter
        assert group.abort_all(error) == 0  # ended once: not counted again
        gate.set()  # the load itself lands; nobody holds a reservation on it
        await until(lambda: group.slots["a"].state == "loaded", "a loaded")
        assert group.slots["a"].reserved == 0 and not group.slots["a"].busy

    run(scenario())
