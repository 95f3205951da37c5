"""`KeyLimitsClient`: each API key's `max_queue` and `rate` as an API process of several holds
them — counted once, for the whole server, by the engine process's `KeyLimits`
(`server.key_limits`), which every request passes through.

`admit` asks the engine process to count the request (`AdmitKey`) and gets a `Ticket` back,
or the same 429 one process gives. The ticket rides on the request's `Submit`, and from
there the engine process drops the count when its own handle ends (or at once if it refuses
the request), before the answer is even sent: a client that gets its answer and sends the
next request, through either API process, finds its place free, as in one process. A ticket
never submitted (a 400 here, a client gone, a retry that joined an Idempotency-Key's first
run) is dropped with `ReleaseKey`; an API process that dies drops all of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, cast

from engine.core.handle import RequestHandle
from engine.core.service import EngineService
from engine.request import GenerationRequest
from server.api_keys import ApiKey
from server.api_servers.client import EngineClient
from server.api_servers.messages import AdmitKey, ChargeKey, ReleaseKey
from server.key_limits import KeyLimitsService, nothing_held


class Ticket:
    """One request's count in the engine process: the release `admit` hands out. Calling it
    drops the count unless a `Submit` has carried it (the engine process drops it then)."""

    def __init__(self, client: EngineClient, ticket: int) -> None:
        self.id = ticket
        self._client = client
        self._settled = False

    def handed_over(self) -> None:
        self._settled = True

    def __call__(self) -> None:
        if not self._settled:
            self._settled = True
            self._client.tell(ReleaseKey(self.id))


class _TicketedEngine(Protocol):
    """What an engine of an API process (`EngineClient`, `ClaimedModel`) takes a ticket with."""

    def submit(self, request: GenerationRequest, *, ticket: int | None = ...) -> RequestHandle: ...


class KeyLimitsClient(KeyLimitsService):
    """`KeyLimitsService` over the engine process's socket (`EngineClient.call`)."""

    def __init__(self, client: EngineClient) -> None:
        self._client = client

    async def admit(self, key: ApiKey | None) -> Callable[[], None]:
        if key is None:
            return nothing_held
        ticket: int = await self._client.call(lambda call_id: AdmitKey(call_id, key.name))
        return Ticket(self._client, ticket)

    async def charge(self, key: ApiKey | None) -> None:
        if key is not None and key.rate is not None:  # else nothing to take: no call
            await self._client.call(lambda call_id: ChargeKey(call_id, key.name))

    def submit(
        self,
        engine: EngineService,
        request: GenerationRequest,
        key: ApiKey | None,
        release: Callable[[], None],
    ) -> RequestHandle:
        if not isinstance(release, Ticket):  # a request without a key: nothing was counted
            return engine.submit(request)
        try:
            handle = cast(_TicketedEngine, engine).submit(request, ticket=release.id)
        except BaseException:
            release()  # refused here, before it was sent
            raise
        release.handed_over()
        return handle
