"""What a video job is, and the one interface every job store offers (`JobStore`).

A job is run by the server whose engine admitted it: that server writes its row already
owned by itself (`owner`) with a lease, and renews the leases of all its unfinished jobs
every so often. Any server sharing the store answers polls and DELETEs from the row, and
any of them fails a job whose lease ran out — its server died — with a reason, so no job
stays `in_progress` forever.

A job belongs to the tenant that created it (`tenant`: the keyed digest of its API key,
`server.tenants`; None without keys). The reads a caller makes take the tenant it sees:
another tenant's job is then missing, as if it did not exist; `tenant=None` sees every job.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

VideoStatus = Literal["queued", "in_progress", "completed", "failed"]

# The columns a `VideoJob` is read from, in its field order.
JOB_COLUMNS = (
    "id, status, progress, created_at, completed_at, expires_at, model, prompt, seconds, size, "
    "error_code, error_message, settings, remixed_from"
)

SERVER_LOST = "server_lost"


class JobStoreUnavailableError(RuntimeError):
    """The store cannot be opened or reached; the message is one line a person can act on
    (a 503 during requests, a start-up error naming `--database-url` before them)."""


@dataclass(frozen=True, slots=True)
class VideoJob:
    id: str
    status: VideoStatus
    progress: int
    created_at: int
    completed_at: int | None
    expires_at: int | None
    model: str
    prompt: str
    seconds: str
    size: str
    error_code: str | None
    error_message: str | None
    # The create request's settings as JSON (all but the prompt, with the seed it ran with,
    # and whether it had an input_reference, kept in `reference_path`): what a remix
    # repeats. None for jobs recorded before remix existed.
    settings: str | None = None
    remixed_from: str | None = None


@dataclass(frozen=True, slots=True)
class KeyRecord:
    """An idempotency key's first use: what the request was (a digest) and, once made, its
    video or (for images, answered inline) its response body: '' if it was too large to keep."""

    fingerprint: str
    video_id: str | None
    response: str | None = None


@dataclass(frozen=True, slots=True)
class PendingDelivery:
    """A webhook event not yet delivered to one URL, and the attempts made so far: kept in
    the store so that a server that stops (or dies) leaves it for another to finish."""

    event_id: str
    url: str
    event_type: str
    created_at: int
    data_id: str
    attempts: int = 0
    # Whose secret signs it: '' the server's, else an API key's tenant digest (the secret
    # itself is never stored: the server making the attempt looks it up in its keys).
    signer: str = ""


# The columns a `PendingDelivery` is read from, in its field order.
DELIVERY_COLUMNS = "event_id, url, event_type, created_at, data_id, attempts, signer"


class JobStore(Protocol):
    """The video job table. Calls are short single-row statements, synchronous: callers make
    them through `AsyncJobStore` (`offloop.py`), in the store's own thread, within a deadline.

    A job ends once: completed or failed, only from queued or in_progress, and it expires
    `ttl_s` later either way (a failed job's row is kept as long as a video would be).
    """

    ttl_s: float
    # Whether other servers may share this store (they may run jobs, delete them, fail them).
    shared: bool
    # The schema version the database was at when this store opened it (0: new or unversioned).
    upgraded_from: int

    def close(self) -> None: ...

    def create(
        self,
        *,
        model: str,
        prompt: str,
        seconds: str,
        size: str,
        settings: str | None = None,
        remixed_from: str | None = None,
        tenant: str | None = None,
    ) -> VideoJob:
        """A queued job of `tenant` (None: of no tenant), owned by this server, its lease
        starting now."""
        ...

    def get(self, job_id: str, tenant: str | None = None) -> VideoJob | None:
        """The job; None if there is none, or (with `tenant`) it is another tenant's."""
        ...

    def exists(self, job_id: str) -> bool: ...

    def page(
        self, *, after: str | None, limit: int, order: Literal["asc", "desc"], tenant: str | None = None
    ) -> tuple[list[VideoJob], bool]:
        """One page in creation order, of `tenant`'s jobs only where one is given; returns
        (jobs, has_more). `KeyError` for an `after` that names no job (deleted, expired or
        never made; or another tenant's): its place in the order is gone with its row, and an
        empty page would read as the end of the list."""
        ...

    def mark_running(self, job_id: str) -> None: ...

    def set_progress(self, job_id: str, progress: int) -> None: ...

    def complete(self, job_id: str) -> bool:
        """Mark the job completed; False if it had already ended (or was deleted)."""
        ...

    def fail(self, job_id: str, code: str, message: str) -> bool:
        """Mark the unfinished job failed; False if it had already ended (or was deleted),
        so that its end is announced once."""
        ...

    def delete(self, job_id: str) -> bool:
        """Remove the row (its files are the caller's); False if there was none."""
        ...

    def take_expired(self) -> list[str]:
        """Delete the rows past their expiry and return their ids (each to one caller only,
        when several servers purge at once), so their files can be removed."""
        ...

    def renew_leases(self) -> set[str]:
        """Extend the lease of this server's unfinished jobs; returns their ids. A job of
        this server missing from it was deleted or failed by another server meanwhile."""
        ...

    def fail_abandoned(self) -> list[str]:
        """Fail the unfinished jobs whose lease ran out (their server stopped renewing it);
        their ids (each to one caller only), so their end can be announced."""
        ...

    def fail_interrupted(self) -> list[str]:
        """At start-up: fail the jobs a previous process left unfinished. A store of one
        server fails them all; a shared store only those whose lease ran out."""
        ...

    def claim_key(self, key: str, fingerprint: str, window_s: float, stale_s: float) -> KeyRecord | None:
        """Record the first use of `key` (kept `window_s`); None if this call made it, else
        the record of the earlier, unexpired use (with any fingerprint). A use that has made
        no video `stale_s` after its claim is taken over (its server died, or recording its
        video failed): the key is not blocked for the whole window."""
        ...

    def bind_key(self, key: str, video_id: str) -> None:
        """The video the key's request made."""
        ...

    def bind_response(self, key: str, response: str) -> None:
        """The response body the key's request answered (images: nothing else is kept)."""
        ...

    def release_key(self, key: str) -> None:
        """The key's request failed before it made anything: a retry may run it again."""
        ...

    def purge_keys(self) -> int:
        """Forget the keys past their window."""
        ...

    # Webhook deliveries still to make (`server/webhooks.py`), leased like the jobs.

    def add_delivery(self, delivery: PendingDelivery) -> None:
        """A delivery this server is making, its lease starting now."""
        ...

    def record_attempts(self, event_id: str, url: str, attempts: int) -> None: ...

    def end_delivery(self, event_id: str, url: str) -> None:
        """Delivered, or given up: forget it."""
        ...

    def keep_deliveries(self) -> list[PendingDelivery]:
        """Renew the leases of this server's deliveries and take over the abandoned ones
        (released at shutdown, or their server stopped renewing them; in a store of one
        server, every other owner's: its previous process's); the taken, each to one caller."""
        ...

    def release_deliveries(self) -> int:
        """At shutdown: leave this server's deliveries to whichever server looks next."""
        ...
