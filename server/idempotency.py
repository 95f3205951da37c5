"""`Idempotency-Key` on the POSTs that make video jobs and images: a retry with the same key
and the same request returns the video the first one made (its current state), or the image
response the first one answered, instead of making another; the same key with another
request is a 409 naming the header.

Keys live in the job store, so they hold across servers sharing it. A key is scoped to the
caller's credentials and the endpoint (stored only as a digest of the three); a request is
compared by a digest of what it asks for once parsed (a multipart body's raw bytes differ
on every retry: the client draws a new boundary).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections.abc import Awaitable, Callable

from fastapi import Request

from server.errors import APIError
from server.jobs.model import JobStoreUnavailableError, KeyRecord, VideoJob
from server.jobs.offloop import AsyncJobStore

HEADER = "Idempotency-Key"
MAX_KEY_CHARS = 255
# How long a retry waits for the first request with its key to record its video (that takes
# milliseconds; longer means the first is stuck or its server died, and the retry says so).
JOIN_WAIT_S = 10.0
# A first use that has recorded no video this long after its claim never will: its server
# died between the two, or recording failed. The key is then free again.
STALE_CLAIM_S = 60.0
# Largest image response kept for retries: `url` answers are far below it; base64 images pass
# it from about one 1024x1024 PNG up, and a database row is no place for many megabytes.
MAX_KEPT_RESPONSE_CHARS = 2 * 2**20


def idempotency_key(request: Request) -> str | None:
    """The request's key, scoped to its caller and endpoint; None without the header."""
    given = request.headers.get(HEADER)
    if given is None:
        return None
    if not given or len(given) > MAX_KEY_CHARS or not given.isprintable():
        raise APIError(400, f"{HEADER} must be 1 to {MAX_KEY_CHARS} printable characters", param=HEADER)
    caller = request.headers.get("authorization", "")
    return hashlib.sha256("\n".join((caller, request.url.path, given)).encode()).hexdigest()


def fingerprint(*parts: bytes | str) -> str:
    digest = hashlib.sha256()
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        digest.update(len(data).to_bytes(8, "big") + data)
    return digest.hexdigest()


async def once(
    store: AsyncJobStore,
    key: str | None,
    request_digest: str,
    window_s: float,
    create: Callable[[], Awaitable[VideoJob]],
) -> VideoJob:
    """`create()` — unless a request with `key` came first: then its video."""
    if key is None:
        return await create()
    first = await _first_use(
        store, key, request_digest, window_s=window_s, stale_s=STALE_CLAIM_S, join_wait_s=JOIN_WAIT_S
    )
    if first is None:  # this request is the first with the key
        try:
            job = await create()
        except BaseException:
            await _release(store, key)  # nothing was made: a retry may run it
            raise
        await store.bind_key(key, job.id)
        return job
    if first.video_id is None:  # a key of an image request: not while keys are per endpoint
        raise APIError(409, f"this {HEADER} was first used by another kind of request", param=HEADER)
    made = await store.get(first.video_id)
    if made is None:
        raise APIError(
            404,
            f"the video this {HEADER} made ({first.video_id}) was deleted or has expired",
            param=HEADER,
            code="not_found",
        )
    return made


async def once_answer(
    store: AsyncJobStore,
    key: str,
    request_digest: str,
    *,
    window_s: float,
    run_s: float,
    answer: Callable[[], Awaitable[str]],
) -> str:
    """The response body `answer()` gives — unless a request with `key` came first: then the
    body it answered, waiting for it while it runs (up to `run_s`, its deadline). Images are
    answered inline, so the body is all there is to keep; one over MAX_KEPT_RESPONSE_CHARS
    (base64 images) is not kept, and its retry is a 409 saying so rather than a second run."""
    # A first use still running is not stale before its deadline: taking its key over would
    # run the work twice.
    first = await _first_use(
        store, key, request_digest, window_s=window_s, stale_s=run_s + STALE_CLAIM_S, join_wait_s=run_s
    )
    if first is None:
        try:
            body = await answer()
        except BaseException:
            await _release(store, key)
            raise
        await store.bind_response(key, body if len(body) <= MAX_KEPT_RESPONSE_CHARS else "")
        return body
    if first.response is None:  # a key of a video request: not while keys are per endpoint
        raise APIError(409, f"this {HEADER} was first used by another kind of request", param=HEADER)
    if not first.response:
        raise APIError(
            409,
            f"the request with this {HEADER} was answered, but its response (over "
            f"{MAX_KEPT_RESPONSE_CHARS // 2**20} MiB of base64 images) was not kept; ask for "
            "response_format=url to make retries return it, or send a new key to run it again",
            param=HEADER,
            code="idempotency_response_not_kept",
        )
    return first.response


async def _release(store: AsyncJobStore, key: str) -> None:
    """Free the key of a request that made nothing. With the store unavailable the claim is
    left to go stale (STALE_CLAIM_S): the request's own error is what its caller needs."""
    with contextlib.suppress(JobStoreUnavailableError):
        await store.release_key(key)


async def _first_use(
    store: AsyncJobStore,
    key: str,
    request_digest: str,
    *,
    window_s: float,
    stale_s: float,
    join_wait_s: float,
) -> KeyRecord | None:
    """None if this request is the first with `key`; else the first's record once it has
    made something (a 409 if it was another request, or still runs after `join_wait_s`)."""
    give_up = time.monotonic() + join_wait_s
    while True:
        first = await store.claim_key(key, request_digest, window_s, stale_s)
        if first is None:
            return None
        if first.fingerprint != request_digest:
            raise APIError(
                409,
                f"this {HEADER} was first used with another request; send a new key for a new request",
                param=HEADER,
                code="idempotency_key_reused",
            )
        if first.video_id is not None or first.response is not None:
            return first
        if time.monotonic() > give_up:
            raise APIError(
                409,
                f"a request with this {HEADER} is still being processed; try again",
                param=HEADER,
                code="idempotency_key_in_use",
                retry=True,
            )
        await asyncio.sleep(0.05)  # the first is still making its video or answer
