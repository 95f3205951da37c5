"""Per-key limits (`--api-key KEY:max_queue=N:rate=R`): how many of a key's requests the
engine may hold at once, and how fast the key may send them. Beyond either, 429 naming the
limit, with Retry-After. Counted by the key's log-safe name (`key#2`), also for /metrics.

A request counts against `max_queue` from its admission until its engine handle ends, for
whatever reason (a result, an error, an abort, a client gone, a deadline): the end of the
handle's future is the one place every ending passes. `rate` is a token bucket holding
about one second's worth of requests (at least one), so a key may send a small burst, then
`rate` a second. Requests without a key (a server without keys) are not limited.

The routes hold a `KeyLimitsService`: this process's `KeyLimits`, or with several API
processes the engine process's, reached over its socket
(`server.api_servers.key_limits_client`), so that a key's limits hold for the whole server.
Its `admit` and `charge` are awaited for that reason; here they return at once.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from engine.core.handle import RequestHandle
from engine.core.service import EngineService
from engine.request import GenerationRequest, RequestOutput
from server.api_keys import ApiKey
from server.errors import APIError


def tenant_of(key: ApiKey | None) -> dict[str, Any]:
    """`GenerationRequest.create`'s sender arguments for a request sent with `key`: the key's
    log-safe name and fair-share weight (`engine.sched.fair_share`); no sender without keys."""
    return {} if key is None else {"tenant": key.name, "tenant_weight": key.weight}


@dataclass(slots=True)
class TokenBucket:
    """`rate` tokens a second, up to `burst`; one per request."""

    rate: float
    burst: float
    tokens: float
    updated: float

    @classmethod
    def full(cls, rate: float, now: float) -> TokenBucket:
        burst = max(1.0, rate)
        return cls(rate, burst, burst, now)

    def take(self, now: float) -> float:
        """Take a token: 0.0 if one was there, else the seconds until one will be (none taken)."""
        self.tokens = min(self.burst, self.tokens + (now - self.updated) * self.rate)
        self.updated = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate


class KeyLimitsService(Protocol):
    """What the routes call to hold a request to its key's limits (`KeyLimits` for its terms)."""

    async def admit(self, key: ApiKey | None) -> Callable[[], None]: ...

    async def charge(self, key: ApiKey | None) -> None: ...

    def submit(
        self,
        engine: EngineService,
        request: GenerationRequest,
        key: ApiKey | None,
        release: Callable[[], None],
    ) -> RequestHandle: ...

    async def generate(
        self,
        engine: EngineService,
        request: GenerationRequest,
        key: ApiKey | None,
        release: Callable[[], None],
    ) -> RequestOutput:
        """`engine.generate(request)` within `key`'s limits (a refusal raises when awaited):
        `submit`, awaited, for every implementation that subclasses this protocol."""
        return await self.submit(engine, request, key, release).result()


class KeyLimits(KeyLimitsService):
    """Each key's requests in the engine and its token bucket; refusals counted by limit."""

    def __init__(self, keys: tuple[ApiKey, ...] = (), clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._buckets = {k.name: TokenBucket.full(k.rate, clock()) for k in keys if k.rate is not None}
        self._keys = {k.name: k for k in keys}
        self.names = tuple(k.name for k in keys)
        self.held: Counter[str] = Counter()
        self.refused: Counter[tuple[str, str]] = Counter()  # (key name, limit)

    def key_named(self, name: str) -> ApiKey | None:
        """The key whose log-safe name is `name` (what an API process names it by), if any."""
        return self._keys.get(name)

    async def admit(self, key: ApiKey | None) -> Callable[[], None]:
        """Count one more request of `key`, or raise 429 naming the limit it would pass.
        Returns the release, to call once when the request ends (calling it again does nothing)."""
        if key is None:
            return nothing_held
        if key.max_queue is not None and self.held[key.name] >= key.max_queue:
            self.refused[key.name, "max_queue"] += 1
            raise _refusal(
                f"this API key already has {key.max_queue} requests in progress (its max_queue); "
                "send more when one has been answered",
                "max_queue",
                1.0,
            )
        self._take_token(key)
        self.held[key.name] += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.held[key.name] -= 1

        return release

    async def charge(self, key: ApiKey | None) -> None:
        """Take a token of `key`'s rate, or raise 429 naming it. Alone, for a request the
        engine never holds (a result-cache hit): it is still a request the key sent, so it
        counts against the rate, not against `max_queue`."""
        self._take_token(key)

    def _take_token(self, key: ApiKey | None) -> None:
        bucket = None if key is None else self._buckets.get(key.name)
        if key is None or bucket is None:
            return
        wait_s = bucket.take(self._clock())
        if wait_s > 0:
            self.refused[key.name, "rate"] += 1
            raise _refusal(
                f"this API key sends more than {key.rate:g} requests a second (its rate limit); "
                f"retry after {math.ceil(wait_s)} s",
                "rate",
                wait_s,
            )

    def submit(
        self,
        engine: EngineService,
        request: GenerationRequest,
        key: ApiKey | None,
        release: Callable[[], None],
    ) -> RequestHandle:
        """`engine.submit(request)` of a request `admit` counted (before its model loaded),
        `release` being what it returned: the count drops when the request ends."""
        try:
            handle = engine.submit(request)
        except BaseException:
            release()  # refused by the engine: it never held it
            raise
        handle.add_done_callback(release)
        return handle


def nothing_held() -> None:
    """The release of a request no limit counted (one without a key)."""


def _refusal(message: str, limit: str, retry_after_s: float) -> APIError:
    return APIError(
        429,
        message,
        type="rate_limit_error",
        param=limit,
        code=f"key_{limit}_exceeded",
        headers={"Retry-After": str(max(1, math.ceil(retry_after_s)))},
    )


class KeyLimitsCollector(Collector):
    """`diffbatch_tenant_requests{tenant}`: each key's requests in the engine (waiting or
    running: what `max_queue` counts); `diffbatch_tenant_refusals_total{tenant,limit}`:
    its requests refused by `max_queue` or `rate`. Labelled by the key's log-safe name."""

    def __init__(self, limits: KeyLimits) -> None:
        self.limits = limits

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        held = GaugeMetricFamily(
            "diffbatch_tenant_requests",
            "requests of an API key the engine holds (waiting or running), by the key's name",
            labels=["tenant"],
        )
        refused = CounterMetricFamily(
            "diffbatch_tenant_refusals",
            "requests of an API key refused by its max_queue or rate limit",
            labels=["tenant", "limit"],
        )
        for name in self.limits.names:
            held.add_metric([name], self.limits.held[name])
            for limit in ("max_queue", "rate"):
                refused.add_metric([name, limit], self.limits.refused[name, limit])
        yield held
        yield refused
