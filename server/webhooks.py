"""Webhook events when a video job ends: `video.completed` and `video.failed` in OpenAI's
shape, signed per Standard Webhooks (`webhook-id`, `webhook-timestamp`,
`webhook-signature`), delivered off the request path, at least once: retried with
exponential backoff until the receiver answers 2xx or the attempts run out.

With a job store (`journal`), each delivery still to make is a row there, leased like a
video job: its server renews it while it retries, and at shutdown leaves what it has not
delivered to whichever server looks next (every third of a lease each server takes over
the deliveries of servers that stopped: released at shutdown, or unrenewed since a crash),
which carries on with the same event id and the attempts left. So an event is delivered
at least once across restarts, and on a shared PostgreSQL by any server of it. The store
is best effort here: when it cannot be reached the delivery goes on in memory (logged).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import httpx

from server.jobs.model import PendingDelivery
from server.jobs.offloop import AsyncJobStore
from server.metrics import Metrics

logger = logging.getLogger(__name__)

MAX_BACKOFF_S = 600.0


def signer(secret: str) -> Any:
    """The Standard Webhooks signer of `secret` (raises for a malformed one)."""
    from standardwebhooks import Webhook

    return Webhook(secret.strip())


@dataclass(frozen=True, slots=True)
class WebhookEvent:
    id: str  # the same on every attempt, so a receiver can drop a repeat
    type: str  # video.completed | video.failed
    created_at: int
    data_id: str  # the video's id

    @classmethod
    def for_video(cls, event_type: str, video_id: str) -> WebhookEvent:
        return cls(f"evt_{secrets.token_hex(16)}", event_type, int(time.time()), video_id)

    @classmethod
    def of(cls, pending: PendingDelivery) -> WebhookEvent:
        return cls(pending.event_id, pending.event_type, pending.created_at, pending.data_id)

    def pending(self, url: str, attempts: int = 0) -> PendingDelivery:
        return PendingDelivery(self.id, url, self.type, self.created_at, self.data_id, attempts)

    def body(self) -> str:
        """OpenAI's event object (as its `client.webhooks.unwrap` reads it)."""
        return json.dumps(
            {
                "id": self.id,
                "object": "event",
                "type": self.type,
                "created_at": self.created_at,
                "data": {"id": self.data_id},
            }
        )


class WebhookSender:
    """Sends each event in a task of its own; `close` stops those still retrying (and, with
    a `journal`, leaves them to the next server; `start` takes over others' in the meantime)."""

    def __init__(
        self,
        secret: str,
        metrics: Metrics,
        *,
        attempts: int = 8,
        backoff_s: float = 1.0,
        timeout_s: float = 10.0,
        journal: AsyncJobStore | None = None,
    ) -> None:
        self._signer = signer(secret)
        self._metrics = metrics
        self._attempts = attempts
        self._backoff_s = backoff_s
        self._journal = journal
        # No redirects: a receiver's 3xx is not a delivery, and following it would let a URL
        # that passed --allowed-webhook-hosts send the event elsewhere.
        self._client = httpx.AsyncClient(timeout=timeout_s, follow_redirects=False)
        self._tasks: set[asyncio.Task[bool]] = set()
        self._keeper: asyncio.Task[None] | None = None

    def send(self, url: str, event: WebhookEvent) -> asyncio.Task[bool]:
        """Start delivering (never blocks the caller); the task ends True once delivered."""
        return self._start(url, event, made=0, new=True)

    def _start(self, url: str, event: WebhookEvent, made: int, new: bool = False) -> asyncio.Task[bool]:
        task = asyncio.create_task(self._deliver(url, event, made, new), name=f"webhook-{event.id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _deliver(self, url: str, event: WebhookEvent, made: int, new: bool) -> bool:
        """Attempts `made + 1` on (`made`: by this or an earlier server); a `new` delivery is
        recorded first (in its task: the caller never waits for the store)."""
        if new:
            await self._record(lambda journal: journal.add_delivery(event.pending(url)))
        body = event.body()
        for attempt in range(made + 1, self._attempts + 1):
            outcome = await self._attempt(url, event, body)
            self._metrics.webhook_attempts.labels(event.type, outcome).inc()
            if outcome == "delivered":
                await self._record(lambda journal: journal.end_delivery(event.id, url))
                return True

            def attempted(journal: AsyncJobStore, made: int = attempt) -> Awaitable[None]:
                return journal.record_attempts(event.id, url, made)

            await self._record(attempted)
            if attempt < self._attempts:
                await asyncio.sleep(self.backoff(attempt))
        await self._record(lambda journal: journal.end_delivery(event.id, url))
        self._metrics.webhook_events_dropped.labels(event.type).inc()
        logger.warning(
            "webhook %s (%s) to %s: gave up after %d attempts", event.id, event.type, url, self._attempts
        )
        return False

    def start(self, every_s: float) -> None:
        """With a journal: take over abandoned deliveries now and every `every_s` (a third
        of the lease, as the video jobs' keeper), renewing this server's own."""
        if self._journal is not None:
            self._keeper = asyncio.create_task(self._keep(every_s), name="diffbatch-webhook-leases")

    async def _keep(self, every_s: float) -> None:
        while True:
            await self.resume_abandoned()
            await asyncio.sleep(every_s)

    async def resume_abandoned(self) -> int:
        """Carry on the deliveries other servers (or this one's last process) left; how many."""
        taken: list[PendingDelivery] = []

        async def keep(journal: AsyncJobStore) -> None:
            taken.extend(await journal.keep_deliveries())

        await self._record(keep)
        for pending in taken:
            logger.info(
                "webhook %s (%s) to %s: resumed after %d attempts elsewhere",
                pending.event_id,
                pending.event_type,
                pending.url,
                pending.attempts,
            )
            self._start(pending.url, WebhookEvent.of(pending), made=pending.attempts)
        return len(taken)

    async def _record(self, call: Callable[[AsyncJobStore], Awaitable[object]]) -> None:
        """Best effort: an unreachable store must not stop a delivery under way."""
        if self._journal is None:
            return
        try:
            await call(self._journal)
        except Exception as exc:  # noqa: BLE001 - JobStoreUnavailableError, sqlite3.Error
            logger.warning("webhook deliveries: the job store cannot record them now (%s)", exc)

    async def _attempt(self, url: str, event: WebhookEvent, body: str) -> str:
        now = datetime.now(tz=UTC)
        headers = {
            "content-type": "application/json",
            "webhook-id": event.id,
            # Signed again on each attempt: receivers refuse timestamps older than minutes.
            "webhook-timestamp": str(int(now.timestamp())),
            "webhook-signature": self._signer.sign(event.id, now, body),
        }
        try:
            answer = await self._client.post(url, content=body, headers=headers)
        except httpx.HTTPError as exc:
            logger.info("webhook %s to %s: %s; will retry", event.id, url, exc or type(exc).__name__)
            return "error"
        if answer.is_success:
            return "delivered"
        logger.info("webhook %s to %s: answered %d; will retry", event.id, url, answer.status_code)
        return "refused"

    def backoff(self, attempt: int) -> float:
        """Before attempt `attempt + 1`: doubling, at most MAX_BACKOFF_S, with up to 10% jitter
        so the events of one outage do not all come back at once."""
        delay: float = min(MAX_BACKOFF_S, self._backoff_s * 2.0 ** (attempt - 1))
        return delay * (1 + random.random() / 10)

    async def close(self, grace_s: float = 5.0) -> None:
        """Give deliveries under way `grace_s` (the events of jobs failed by the shutdown
        itself among them), then stop the rest: left in the journal for the next server to
        resume, or else dropped."""
        if self._keeper is not None:
            self._keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._keeper
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=grace_s)
        unfinished = len(self._tasks)
        for task in list(self._tasks):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        released: list[int] = []

        async def release(journal: AsyncJobStore) -> None:
            released.append(await journal.release_deliveries())

        await self._record(release)
        if released and released[0]:
            logger.warning(
                "%d webhook deliveries still undelivered at shutdown are left in the job store: "
                "the next server to look resumes them",
                released[0],
            )
        elif unfinished:
            logger.warning("%d webhook events still undelivered at shutdown are dropped", unfinished)
        await self._client.aclose()


class VideoEvents:
    """Who hears of a video job's end: the server's `--webhook-url`, and the job's own
    `webhook_url` when its request named one (kept here until the job ends)."""

    def __init__(self, sender: WebhookSender | None = None, url: str | None = None) -> None:
        self.sender = sender
        self._url = url
        self._own: dict[str, str] = {}

    def expect(self, job_id: str, own_url: str | None) -> None:
        if own_url is not None:
            self._own[job_id] = own_url

    def ended(self, job_id: str, event_type: str, own_url: str | None = None) -> None:
        """`own_url`: the job's webhook_url when this server did not take its request."""
        own_url = self._own.pop(job_id, own_url)
        urls = {url for url in (self._url, own_url) if url is not None}
        if self.sender is None:
            return
        event = WebhookEvent.for_video(event_type, job_id)
        for url in sorted(urls):
            self.sender.send(url, event)

    def forget(self, job_id: str) -> None:
        self._own.pop(job_id, None)
