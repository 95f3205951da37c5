"""What the calls of `--api-server-count N` (N > 1) to the engine process's shared state cost:
an API key's count (`AdmitKey`, then `ReleaseKey`) and a result-cache hit (`CacheGet`) of a
small and of a 1024²-PNG-sized entry, each awaited in turn over a Unix socket as an API
process awaits them, both ends in one event loop (so each figure is both processes' CPU
together). One process (N = 1) makes no such call.

    python -m bench.shared_state_calls
"""

from __future__ import annotations

import asyncio
import functools
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from engine.core.config import EngineConfig
from engine.core.engine import AsyncEngine
from engine.executor.thread_executor import ThreadExecutor
from engine.worker.pipeline import HostedPipeline
from server.api_keys import parse_api_keys
from server.api_servers.client import EngineClient
from server.api_servers.host import EngineHost
from server.api_servers.key_limits_client import KeyLimitsClient
from server.api_servers.result_cache_client import ResultCacheClient
from server.key_limits import KeyLimits
from server.result_cache import CachedImages, ResultCache

CALLS = 1000
# Encoded images of these sizes: a small one, and a 1024x1024 PNG at the default level.
ENTRY_BYTES = {"8 KB entry": 8_000, "1.5 MB entry": 1_500_000}


def _never_loaded() -> HostedPipeline:
    raise AssertionError("the engine is never started here: its host answers the calls")


async def _per_call_ms(call: Callable[[], Awaitable[object]], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        await call()
    return (time.perf_counter() - start) / calls * 1000


async def run(directory: Path) -> dict[str, float]:
    (key,) = parse_api_keys("bench-key:max_queue=1000000")
    engine = AsyncEngine(ThreadExecutor(_never_loaded), EngineConfig(4))  # never started: the host answers
    host = EngineHost(engine, lambda: b"", KeyLimits((key,)), ResultCache(2**30))
    await host.listen(directory / "engine.sock")
    client = EngineClient(directory / "engine.sock")
    await client.start()
    limits, cache = KeyLimitsClient(client), ResultCacheClient(client)

    async def admit_and_release() -> None:
        (await limits.admit(key))()

    figures = {"AdmitKey + ReleaseKey": await _per_call_ms(admit_and_release, CALLS)}
    for label, size in ENTRY_BYTES.items():
        await cache.put(label, CachedImages((b"x" * size,), (1,), "1024x1024"))
        calls = CALLS if size < 2**20 else CALLS // 10
        figures[f"CacheGet hit, {label}"] = await _per_call_ms(functools.partial(cache.get, label), calls)
    await client.stop()
    while host.connections:  # the host's side of the link ends before the loop does
        await asyncio.sleep(0.01)
    await host.close()
    return figures


def main() -> None:
    with tempfile.TemporaryDirectory() as directory:
        figures = asyncio.run(run(Path(directory)))
    for name, ms in figures.items():
        print(f"{name}: {ms:.2f} ms")


if __name__ == "__main__":
    main()
