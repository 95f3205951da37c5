"""`RequestHandle`: what `AsyncEngine.submit` gives the owner of an admitted request.

Admission happens in `submit` itself, so a refusal (bad input, a full queue) raises before
any response has started; the handle then carries the request to its end: await
`result()`, or iterate `events()` for its previews (`partial_images`) followed by its
output. Whoever holds the handle owns the request: cancelling the task that awaits it, or
closing the `events()` iterator early, aborts the request in the engine.

An engine in another process (`server.api_servers.client`) admits the request there, after
`submit` has returned: `accepted()` waits for that answer, so a refusal can still be an HTTP
error before a stream starts. An engine in this process has answered in `submit` already.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Callable

from engine.errors import DeadlineExceededError
from engine.request import GenerationRequest, PartialImage, RequestOutput

# What `events()` yields: previews, then the output; None is a heartbeat (nothing new for
# `heartbeat_s`), which a streaming response turns into a keep-alive comment.
Event = PartialImage | RequestOutput | None


class RequestHandle:
    def __init__(
        self,
        request: GenerationRequest,
        future: asyncio.Future[RequestOutput],
        partials: asyncio.Queue[PartialImage],
        abort: Callable[[str], bool],
        accepted: asyncio.Future[None] | None = None,
    ) -> None:
        self.request = request  # as admitted: model defaults and seed filled in
        self._future = future
        self._partials = partials
        self._abort = abort
        self._accepted = accepted  # None: admitted in `submit` already

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def add_done_callback(self, callback: Callable[[], None]) -> None:
        """Call `callback` once the request has ended, however it ended: a result, an error,
        an abort (the client gone, its deadline passed), or the engine stopping."""
        self._future.add_done_callback(lambda _: callback())

    async def accepted(self) -> None:
        """Returns once the engine holds the request; raises its refusal (a full queue, a
        duplicate id) if it did not take it. At once for an engine in this process."""
        if self._accepted is not None:
            await self._accepted

    def abort(self) -> bool:
        """End the request now (it never runs, or it leaves its batch at the next step)."""
        return self._abort(self.request_id)

    async def result(self) -> RequestOutput:
        """The request's output, or the reason it has none (raised). Past its deadline the
        request is aborted and `DeadlineExceededError` raised; if the awaiting task is
        cancelled (the client went away) the request is aborted too."""
        deadline = self.request.deadline
        timeout = None if deadline is None else deadline - time.monotonic()
        try:
            async with asyncio.timeout(timeout):
                return await self._future
        except TimeoutError:
            self.abort()
            raise DeadlineExceededError(
                f"request {self.request_id} did not finish before its deadline"
            ) from None
        except asyncio.CancelledError:
            self.abort()
            raise

    async def events(self, heartbeat_s: float | None = None) -> AsyncGenerator[Event, None]:
        """Each preview as it is made, then the output (an error is raised instead). Yields
        None after `heartbeat_s` without news. Closing the iterator early aborts the request."""
        result = asyncio.ensure_future(self.result())
        try:
            while True:
                preview = asyncio.ensure_future(self._partials.get())
                done, _ = await asyncio.wait(
                    {preview, result}, timeout=heartbeat_s, return_when="FIRST_COMPLETED"
                )
                if preview in done:
                    yield preview.result()
                    continue
                preview.cancel()
                if result not in done:
                    yield None
                    continue
                # Previews are routed before the output they precede.
                while not self._partials.empty():
                    yield self._partials.get_nowait()
                yield result.result()
                return
        finally:
            if not result.done():
                self.abort()  # now, not when the cancelled task next runs
                result.cancel()


def settle(future: asyncio.Future[RequestOutput] | None, outcome: RequestOutput | Exception) -> None:
    """Resolve a request's future exactly once; a missing, done or cancelled one is left
    alone (the request was answered already, or its owner went away)."""
    if future is None or future.done():
        return
    if isinstance(outcome, Exception):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)
