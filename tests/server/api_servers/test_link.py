"""An `EngineClient` and an `EngineHost` over a real Unix socket, in one event loop, over an
`AsyncEngine` of a fake pipeline: what crosses the boundary and what each end does when the
other goes away (no server process; milliseconds)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from engine.core.config import EngineConfig
from engine.core.engine import AsyncEngine
from engine.core.lanes import WorkerHealth
from engine.errors import DuplicateRequestError, EngineRestartingError, RequestAbortedError
from engine.executor.thread_executor import ThreadExecutor
from engine.request import InvalidRequestError
from server.api_servers.client import EngineClient
from server.api_servers.host import EngineHost
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
async def linked(tmp_path: Path) -> AsyncIterator[tuple[AsyncEngine, EngineHost, EngineClient, HeldPipeline]]:
    pipeline = HeldPipeline()
    engine = AsyncEngine(ThreadExecutor(lambda: pipeline), EngineConfig(4, batching="request"))
    host = EngineHost(engine, lambda: b"# the engine's text\n")
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
