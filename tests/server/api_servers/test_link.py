"""An `EngineClient` and an `EngineHost` over a real Unix socket, in one event loop, over an
`AsyncEngine` of a fake pipeline: what crosses the boundary and what each end does when the
other goes away (no server process; milliseconds)."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from engine.core.config import EngineConfig
from engine.core.engine import AsyncEngine
from engine.core.lanes import WorkerHealth
from engine.errors import DuplicateRequestError, EngineRestartingError, RequestAbortedError
from engine.executor.thread_executor import ThreadExecutor
from engine.logs import EVENTS, REQUEST, RequestContext
from engine.request import InvalidRequestError
from server.api_keys import parse_api_keys
from server.api_servers.client import EngineClient
from server.api_servers.host import EngineHost
from server.api_servers.key_limits_client import KeyLimitsClient
from server.api_servers.result_cache_client import ResultCacheClient
from server.errors import APIError
from server.key_limits import KeyLimits
from server.result_cache import CachedImages, ResultCache
from tests.engine.fakes import FakePipeline, make_request
from tests.polling import until


class HeldPipeline(FakePipeline):
    """`FakePipeline`, its forwards held until the test sets `held`; its spec crosses a
    process (without the test's events)."""

    def __init__(self) -> None:
        super().__init__()
        self.held = threading.Event()
        self.gate = self.held

    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        HeldPipeline.__init__(self)


@asynccontextmanager
async def linked(
    tmp_path: Path, key_limits: KeyLimits | None = None, result_cache: ResultCache | None = None
) -> AsyncIterator[tuple[AsyncEngine, EngineHost, EngineClient, HeldPipeline]]:
    pipeline = HeldPipeline()
    engine = AsyncEngine(ThreadExecutor(lambda: pipeline), EngineConfig(4, batching="request"))
    host = EngineHost(engine, lambda: b"# the engine's text\n", key_limits, result_cache)
    await host.listen(tmp_path / "engine.sock")
    await engine.start()
    client = EngineClient(tmp_path / "engine.sock")
    await client.start()
    await until(lambda: client.is_running, "the client saw the engine running")
    try:
        yield engine, host, client, pipeline
    finally:
        pipeline.held.set()
        await client.stop()
        await host.close()
        await engine.stop()


def test_a_request_its_refusals_and_its_abort_cross_the_socket(tmp_path: Path) -> None:
    async def run() -> None:
        async with linked(tmp_path) as (engine, _, client, pipeline):
            assert await client.metrics_text() == b"# the engine's text\n"
            with pytest.raises(InvalidRequestError, match="width"):  # admitted here, at submit
                client.submit(make_request("big", size=2048))
            held = client.submit(make_request("held", prompt="first"))
            await held.accepted()
            await until(pipeline.started.is_set, "the engine runs it")
            # The engine process refuses a second request with its id: before any stream starts.
            other = EngineClient(tmp_path / "engine.sock")
            await other.start()
            await until(lambda: other.is_running, "the second client saw the engine")
            with pytest.raises(DuplicateRequestError):
                await other.submit(make_request("held")).accepted()
            waiting = client.submit(make_request("waiting", size=128))  # another key: waits
            await waiting.accepted()
            assert waiting.abort()
            with pytest.raises(RequestAbortedError):
                await waiting.result()
            await until(lambda: engine.num_waiting == 0, "the abort reached the engine")
            pipeline.held.set()
            output = await held.result()
            assert output.images == (("first", output.seeds[0]),)
            await other.stop()

    asyncio.run(run())


def test_a_lost_engine_ends_requests_with_503_and_a_lost_api_process_aborts_its_own(tmp_path: Path) -> None:
    async def run() -> None:
        async with linked(tmp_path) as (engine, host, client, pipeline):
            other = EngineClient(tmp_path / "engine.sock")
            await other.start()
            await until(lambda: other.is_running, "the second client saw the engine")
            gone = other.submit(make_request("gone"))
            await gone.accepted()
            await until(pipeline.started.is_set, "the engine runs it")
            await other.stop()  # its API process went away: the engine drops its request
            await until(lambda: engine.num_unfinished == 0, "the engine aborted it")
            lost = client.submit(make_request("lost", size=128))
            await lost.accepted()
            await host.close()  # as the engine process dying closes every connection
            with pytest.raises(EngineRestartingError):
                await lost.result()
            await until(lambda: client.unavailable is not None, "the client says the engine is away")
            with pytest.raises(EngineRestartingError):
                client.submit(make_request("meanwhile"))
            await host.listen(tmp_path / "engine.sock")  # back: the client reconnects by itself
            await until(lambda: client.unavailable is None, "the client reconnected")
            pipeline.held.set()
            assert (await client.generate(make_request("again"))).request_id == "again"

    asyncio.run(run())


def test_a_change_of_health_reaches_every_api_process_before_the_answer_it_came_with(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker that dies fails its request and changes /health: whoever reads the answer
    and then asks /health, of this API process or another, reads the change, not a snapshot
    up to a quarter-second old (the ticker is stopped here: only the answer can bring it)."""

    async def run() -> None:
        async with linked(tmp_path) as (engine, host, client, pipeline):
            other = EngineClient(tmp_path / "engine.sock")
            await other.start()
            await until(lambda: other.worker_health() == WorkerHealth(1, 1), "the workers crossed")
            assert host._ticker is not None
            host._ticker.cancel()
            down = WorkerHealth(1, 0, ("worker 0: restarting after a crash",))
            monkeypatch.setattr(engine, "worker_health", lambda: down)
            pipeline.held.set()
            await client.generate(make_request("answered"))
            assert client.worker_health() == down
            await until(lambda: other.worker_health() == down, "the other process heard it too")
            await other.stop()

    asyncio.run(run())


async def _second_client(path: Path) -> EngineClient:
    """Another API process's link to the same engine process."""
    other = EngineClient(path)
    await other.start()
    await until(lambda: other.is_running, "the second client saw the engine")
    return other


async def _refusal(admitting: Awaitable[object]) -> dict[str, object]:
    with pytest.raises(APIError) as caught:
        await admitting
    return vars(caught.value)


def test_a_keys_limits_are_counted_once_for_every_api_process(tmp_path: Path) -> None:
    """Two API processes' `KeyLimitsClient`s share the engine process's `KeyLimits`: a key at
    its `max_queue` through one is refused through the other, with the very 429 one process
    gives, and its place is free by the time its answer arrives; a rate token taken through
    one is gone for the other; the counts of a request the engine refuses, of one never
    submitted and of an API process that went away are dropped."""
    entries = "k-queue:max_queue=1,k-rate:rate=0.001,k-free"
    queue_key, rate_key, free_key = parse_api_keys(entries)
    limits, one_process = KeyLimits(parse_api_keys(entries)), KeyLimits(parse_api_keys(entries))

    async def run() -> None:
        async with linked(tmp_path, key_limits=limits) as (_, _, client, pipeline):
            other = await _second_client(tmp_path / "engine.sock")
            here, there = KeyLimitsClient(client), KeyLimitsClient(other)
            held = here.submit(client, make_request("held"), queue_key, await here.admit(queue_key))
            await held.accepted()
            assert limits.held[queue_key.name] == 1
            await one_process.admit(queue_key)
            assert await _refusal(there.admit(queue_key)) == await _refusal(one_process.admit(queue_key))

            refused = there.submit(other, make_request("held"), free_key, await there.admit(free_key))
            with pytest.raises(DuplicateRequestError):
                await refused.accepted()
            assert limits.held[free_key.name] == 0  # dropped before the refusal was sent

            pipeline.held.set()
            await held.result()
            again = await there.admit(queue_key)  # free as the answer arrives, through either process
            again()  # never submitted: dropped by a message of its own
            await until(lambda: limits.held[queue_key.name] == 0, "the unsubmitted count dropped")

            (await here.admit(rate_key))()
            await one_process.admit(rate_key)
            assert await _refusal(there.charge(rate_key)) == await _refusal(one_process.charge(rate_key))
            assert limits.refused == {(queue_key.name, "max_queue"): 1, (rate_key.name, "rate"): 1}

            await there.admit(free_key)
            assert limits.held[free_key.name] == 1
            await other.stop()  # its API process went away with a request counted
            await until(lambda: limits.held[free_key.name] == 0, "the gone process's count dropped")

    asyncio.run(run())


def test_the_result_cache_is_one_for_every_api_process(tmp_path: Path) -> None:
    """What one API process stores, another finds (the images crossing beside the message),
    hits and misses counted once in the engine process; with the engine process away, a
    lookup is a miss and a store is dropped, neither an error."""
    cache = ResultCache(2**20)
    entry = CachedImages((b"\x89PNG one", b"\x89PNG two"), (1, 2), "64x64")

    async def run() -> None:
        async with linked(tmp_path, result_cache=cache) as (_, host, client, _):
            other = await _second_client(tmp_path / "engine.sock")
            here, there = ResultCacheClient(client), ResultCacheClient(other)
            assert await there.get("k") is None
            await here.put("k", entry)
            assert await there.get("k") == entry
            assert (cache.hits, cache.misses, len(cache)) == (1, 1, 1)
            await other.stop()
            await host.close()
            await until(lambda: client.unavailable is not None, "the client saw the engine go")
            assert await here.get("k") is None
            await here.put("k2", entry)
            assert (cache.hits, cache.misses, len(cache)) == (1, 1, 1)

    asyncio.run(run())


class _ContextSeen(logging.Handler):
    """Each request-life event and the request context bound when it was logged."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.seen: list[tuple[str, RequestContext | None]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.append((getattr(record, "event", ""), REQUEST.get()))


def test_the_engine_process_logs_a_request_with_the_fields_its_api_process_bound(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=EVENTS.name)
    handler = _ContextSeen()
    EVENTS.addHandler(handler)
    bound = RequestContext("bound", "model-a", "tenant-digest")

    async def run() -> None:
        async with linked(tmp_path) as (_, _, client, pipeline):
            pipeline.held.set()
            REQUEST.set(bound)  # as `server.request_log.received` binds it in the route's task
            await client.generate(make_request("bound"))
            REQUEST.set(None)
            await client.generate(make_request("unbound"))  # nothing left bound from the first

    try:
        asyncio.run(run())
    finally:
        EVENTS.removeHandler(handler)
    assert handler.seen == [("queued", bound), ("finished", bound), ("queued", None), ("finished", None)]
