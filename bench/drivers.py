"""Load shapes: how a trace of requests is sent to one contender.

- closed loop: C clients; each sends its next request as soon as its last one is answered
  (continuous, so cohorts form or not as the server makes them);
- open loop: requests leave at their Poisson arrival times whatever the server does;
- bursts: B requests at once, the next burst when all are answered.
Every driver times each request on the same clock (`time.perf_counter`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from bench.workload import RequestSpec


@dataclass(frozen=True, slots=True)
class Outcome:
    """What a contender says of one request: outputs made, or why not."""

    ok: bool
    outputs: int = 0
    first_byte: float | None = None  # perf_counter time of the first response byte
    error: str | None = None
    status: int | None = None  # the HTTP status of a failure (429: refused at admission)


@dataclass(frozen=True, slots=True)
class Sample:
    """One request as measured: times in seconds from the start of its round."""

    index: int
    sent: float
    done: float
    ok: bool
    outputs: int
    first_byte: float | None = None
    error: str | None = None
    # Previews (`partial_images`) it asked for: a mix compares those without to those with.
    partials: int = 0
    model: str | None = None  # the model it named (a server of several models)
    # Service levels: what the request asked for and was (drawn in its spec), and the HTTP
    # status it failed with (a 429 refusal counts apart from other misses).
    status: int | None = None
    priority: int | None = None
    tenant: int | None = None
    klass: str | None = None
    deadline_s: float | None = None

    @property
    def latency(self) -> float:
        return self.done - self.sent

    @property
    def ttfb(self) -> float | None:
        return None if self.first_byte is None else self.first_byte - self.sent


Send = Callable[[RequestSpec], Awaitable[Outcome]]


async def _timed(send: Send, index: int, spec: RequestSpec, start: float) -> Sample:
    sent = time.perf_counter()
    try:
        outcome = await send(spec)
    except Exception as exc:  # noqa: BLE001 - a transport failure is a failed sample, not a crash
        outcome = Outcome(ok=False, error=f"{type(exc).__name__}: {exc}")
    done = time.perf_counter()
    first = None if outcome.first_byte is None else outcome.first_byte - start
    return Sample(
        index,
        sent - start,
        done - start,
        outcome.ok,
        outcome.outputs,
        first,
        outcome.error,
        spec.partial_images,
        spec.model,
        outcome.status,
        spec.priority,
        spec.tenant,
        spec.klass,
        spec.deadline_s,
    )


async def closed_loop(send: Send, specs: Sequence[RequestSpec], concurrency: int) -> list[Sample]:
    start = time.perf_counter()
    pending = iter(enumerate(specs))
    samples: list[Sample] = []

    async def client() -> None:
        for index, spec in pending:  # the shared iterator hands each request out once
            samples.append(await _timed(send, index, spec, start))

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return samples


async def open_loop(send: Send, specs: Sequence[RequestSpec], offsets: Sequence[float]) -> list[Sample]:
    start = time.perf_counter()

    async def at(index: int, spec: RequestSpec, offset: float) -> Sample:
        await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
        return await _timed(send, index, spec, start)

    return list(
        await asyncio.gather(
            *(at(i, spec, offset) for i, (spec, offset) in enumerate(zip(specs, offsets, strict=True)))
        )
    )


async def bursts(send: Send, specs: Sequence[RequestSpec], size: int) -> list[Sample]:
    start = time.perf_counter()
    samples: list[Sample] = []
    for first in range(0, len(specs), size):
        chunk = specs[first : first + size]
        samples.extend(
            await asyncio.gather(*(_timed(send, first + i, spec, start) for i, spec in enumerate(chunk)))
        )
    return samples
