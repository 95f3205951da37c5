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

Each delivery names its signer, not its secret: the server (`--webhook-secret`, for
`--webhook-url`) or the API key whose request named the URL (by its tenant digest; its
`webhook_secret` is looked up in this server's keys when the attempt is made), so one
tenant's secret never signs another's events. A receiver cannot hurt the server: any
failure of an attempt is a failed attempt (counted, retried), each attempt has a total
deadline, the answer's body is never read, and at most `PER_RECEIVER` attempts go to one
receiver (scheme, host and port) at once. URLs are logged without user info or query (`redacted_url`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import secrets
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import httpx

from server.api_keys import ApiKey
from server.jobs.model import PendingDelivery
from server.jobs.offloop import AsyncJobStore
from server.metrics import Metrics
from server.tenants import Tenants
from server.webhook_urls import parse_webhook_url, redacted_url

logger = logging.getLogger(__name__)

MAX_BACKOFF_S = 600.0
# Attempts under way to one receiver at once: receivers that hang (each until its attempt's
# deadline) hold this many connections, never those other receivers need.
PER_RECEIVER = 8
# Connections in all (a bound on open sockets); reached only with dozens of hanging
# receivers, and then an attempt waits for one within its deadline.
MAX_CONNECTIONS = 256

# The signer of `--webhook-url`'s events (and, on a server without API keys, of a request's
# own webhook_url): `--webhook-secret`. Rows stored before signers were kept read as this.
SERVER_SIGNER = ""


def webhook_signer(tenant: str | None) -> str:
    """Who signs the events of a request's own webhook_url: its API key, by its tenant
    digest (`server.tenants`: stored, where the secret never is), or the server when it has
    no keys."""
    return SERVER_SIGNER if tenant is None else tenant


def signing_secrets(server_secret: str | None, keys: Iterable[ApiKey], tenants: Tenants) -> dict[str, str]:
    """Each signer this server knows and its secret: the server's, and each key's own."""
    known = {
        webhook_signer(tenants.of(key)): key.webhook_secret for key in keys if key.webhook_secret is not None
    }
    if server_secret is not None:
        known[SERVER_SIGNER] = server_secret
    return known


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

    def pending(self, url: str, signer: str, attempts: int = 0) -> PendingDelivery:
        return PendingDelivery(self.id, url, self.type, self.created_at, self.data_id, attempts, signer)

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


class ReceiverSlots:
    """At most `per_receiver` attempts to one receiver (an origin: scheme, host and port)
    at once; the rest wait their turn (not counted against their deadline: they have not
    begun)."""

    def __init__(self, per_receiver: int = PER_RECEIVER) -> None:
        self._per_receiver = per_receiver
        self._slots: dict[str, asyncio.Semaphore] = {}
        self._users: Counter[str] = Counter()  # waiting or holding, so idle ones are forgotten

    @contextlib.asynccontextmanager
    async def slot(self, url: httpx.URL) -> AsyncIterator[None]:
        port = url.port or (443 if url.scheme == "https" else 80)
        origin = f"{url.scheme}://{url.raw_host.decode('ascii').lower()}:{port}"
        if origin not in self._slots:
            self._slots[origin] = asyncio.Semaphore(self._per_receiver)
        self._users[origin] += 1
        try:
            async with self._slots[origin]:
                yield
        finally:
            self._users[origin] -= 1
            if not self._users[origin]:
                del self._users[origin], self._slots[origin]


class WebhookSender:
    """Sends each event in a task of its own; `close` stops those still retrying (and, with
    a `journal`, leaves them to the next server; `start` takes over others' in the meantime).
    `secrets`: each signer's secret (`signing_secrets`)."""

    def __init__(
        self,
        secrets: Mapping[str, str],
        metrics: Metrics,
        *,
        attempts: int = 8,
        backoff_s: float = 1.0,
        timeout_s: float = 10.0,
        journal: AsyncJobStore | None = None,
    ) -> None:
        self._signers = {name: signer(secret) for name, secret in secrets.items()}
        self._metrics = metrics
        self._attempts = attempts
        self._backoff_s = backoff_s
        self._timeout_s = timeout_s
        self._journal = journal
        # No redirects: a receiver's 3xx is not a delivery, and following it would let a URL
        # that passed --allowed-webhook-hosts send the event elsewhere. httpx's timeout is
        # per operation (each read may take it); `_attempt` bounds the whole attempt.
        self._client = httpx.AsyncClient(
            timeout=timeout_s,
            follow_redirects=False,
            limits=httpx.Limits(max_connections=MAX_CONNECTIONS, max_keepalive_connections=32),
        )
        self._receivers = ReceiverSlots()
        self._tasks: set[asyncio.Task[bool]] = set()
        self._keeper: asyncio.Task[None] | None = None

    def send(self, url: str, event: WebhookEvent, signer: str = SERVER_SIGNER) -> asyncio.Task[bool]:
        """Start delivering (never blocks the caller); the task ends True once delivered."""
        return self._start(url, event, signer, made=0, new=True)

    def _start(
        self, url: str, event: WebhookEvent, signer: str, made: int, new: bool = False
    ) -> asyncio.Task[bool]:
        task = asyncio.create_task(self._deliver(url, event, signer, made, new), name=f"webhook-{event.id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _deliver(self, url: str, event: WebhookEvent, signer: str, made: int, new: bool) -> bool:
        """Attempts `made + 1` on (`made`: by this or an earlier server); a `new` delivery is
        recorded first (in its task: the caller never waits for the store). Never raises (but
        for cancellation): a delivery that cannot be made is given up, logged."""
        if new:
            await self._record(lambda journal: journal.add_delivery(event.pending(url, signer)))
        why = self._unsendable(url, signer)
        if why is None:
            if await self._attempt_until_delivered(url, event, signer, made):
                await self._record(lambda journal: journal.end_delivery(event.id, url))
                return True
            why = f"gave up after {self._attempts} attempts"
        await self._record(lambda journal: journal.end_delivery(event.id, url))
        self._metrics.webhook_events_dropped.labels(event.type).inc()
        logger.warning("webhook %s (%s) to %s: %s", event.id, event.type, redacted_url(url), why)
        return False

    def _unsendable(self, url: str, signer: str) -> str | None:
        """Why no attempt can succeed (a row stored before URLs were checked as httpx reads
        them, or signed by a key this server does not have), else None."""
        try:
            parse_webhook_url(url)
        except ValueError as exc:
            return f"the URL {exc}; given up without an attempt"
        if signer not in self._signers:
            return (
                f"to be signed by the API key of tenant {signer}, which this server's keys do not "
                "hold with a webhook_secret (servers sharing a job store should share their keys); "
                "given up without an attempt"
            )
        return None

    async def _attempt_until_delivered(self, url: str, event: WebhookEvent, signer: str, made: int) -> bool:
        body = event.body()
        for attempt in range(made + 1, self._attempts + 1):
            outcome = await self._attempt(url, event, body, signer, attempt)
            self._metrics.webhook_attempts.labels(event.type, outcome).inc()
            if outcome == "delivered":
                return True

            def attempted(journal: AsyncJobStore, made: int = attempt) -> Awaitable[None]:
                return journal.record_attempts(event.id, url, made)

            await self._record(attempted)
            if attempt < self._attempts:
                await asyncio.sleep(self.backoff(attempt))
        return False

    def start(self, every_s: float) -> None:
        """With a journal: take over abandoned deliveries now and every `every_s` (a third
        of the lease, as the video jobs' keeper), renewing this server's own."""
        if self._journal is not None:
            self._keeper = asyncio.create_task(self._keep(every_s), name="diffbatch-webhook-leases")

    async def _keep(self, every_s: float) -> None:
        while True:
            try:
                await self.resume_abandoned()
            except Exception:  # the keeper must outlive any one round
                logger.exception("webhook deliveries: taking over abandoned ones failed; trying again later")
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
                redacted_url(pending.url),
                pending.attempts,
            )
            self._start(pending.url, WebhookEvent.of(pending), pending.signer, made=pending.attempts)
        return len(taken)

    async def _record(self, call: Callable[[AsyncJobStore], Awaitable[object]]) -> None:
        """Best effort: an unreachable store must not stop a delivery under way."""
        if self._journal is None:
            return
        try:
            await call(self._journal)
        except Exception as exc:  # noqa: BLE001 - JobStoreUnavailableError, sqlite3.Error
            logger.warning("webhook deliveries: the job store cannot record them now (%s)", exc)

    async def _attempt(self, url: str, event: WebhookEvent, body: str, signer: str, attempt: int) -> str:
        """One attempt's outcome: delivered, refused (a non-2xx answer) or error (anything
        else that went wrong: no answer within the deadline, a connection refused, ...)."""
        try:
            async with (
                self._receivers.slot(parse_webhook_url(url)),
                asyncio.timeout(self._timeout_s),
            ):
                status = await self._post(url, self._headers(event, body, signer), body)
        except Exception as exc:  # noqa: BLE001 - whatever it is, the attempt failed; the task goes on
            logger.info(
                "webhook %s to %s (attempt %d of %d): %s",
                event.id,
                redacted_url(url),
                attempt,
                self._attempts,
                self._failure(exc, url),
            )
            return "error"
        if 200 <= status < 300:
            return "delivered"
        logger.info(
            "webhook %s to %s (attempt %d of %d): answered %d",
            event.id,
            redacted_url(url),
            attempt,
            self._attempts,
            status,
        )
        return "refused"

    def _headers(self, event: WebhookEvent, body: str, signer: str) -> dict[str, str]:
        now = datetime.now(tz=UTC)
        return {
            "content-type": "application/json",
            "webhook-id": event.id,
            # Signed again on each attempt: receivers refuse timestamps older than minutes.
            "webhook-timestamp": str(int(now.timestamp())),
            "webhook-signature": self._signers[signer].sign(event.id, now, body),
        }

    async def _post(self, url: str, headers: dict[str, str], body: str) -> int:
        # The status is the whole answer: the body is never read (a receiver could send
        # gigabytes); leaving it unread closes the connection instead of reusing it.
        async with self._client.stream("POST", url, content=body, headers=headers) as answer:
            return answer.status_code

    def _failure(self, exc: Exception, url: str) -> str:
        """What went wrong, for the log: the exception's type (some have no text) and text,
        without the URL's secrets."""
        if isinstance(exc, TimeoutError):  # asyncio.timeout's, bounding the whole attempt
            return f"no answer within {self._timeout_s:g} s ({type(exc).__name__})"
        text = str(exc).replace(url, redacted_url(url))
        return f"{type(exc).__name__}: {text}" if text else type(exc).__name__

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


@dataclass(frozen=True, slots=True)
class OwnWebhook:
    """A job's own `webhook_url` and who signs its events (`webhook_signer`)."""

    url: str
    signer: str = SERVER_SIGNER


class VideoEvents:
    """Who hears of a video job's end: the server's `--webhook-url`, and the job's own
    `webhook_url` when its request named one (kept here until the job ends)."""

    def __init__(self, sender: WebhookSender | None = None, url: str | None = None) -> None:
        self.sender = sender
        self._url = url
        self._own: dict[str, OwnWebhook] = {}

    def expect(self, job_id: str, own: OwnWebhook | None) -> None:
        if own is not None:
            self._own[job_id] = own

    def ended(self, job_id: str, event_type: str, own: OwnWebhook | None = None) -> None:
        """`own`: the job's webhook when this server did not take its request."""
        own = self._own.pop(job_id, own)
        # The server's URL is signed by the server, even when a job names it as its own.
        signers = {} if own is None else {own.url: own.signer}
        if self._url is not None:
            signers[self._url] = SERVER_SIGNER
        if self.sender is None:
            return
        event = WebhookEvent.for_video(event_type, job_id)
        for url in sorted(signers):
            self.sender.send(url, event, signers[url])

    def forget(self, job_id: str) -> None:
        self._own.pop(job_id, None)
