"""`Idempotency-Key` on the POSTs that make video jobs: a retry with the same key and the same
request returns the video the first one made (its current state) instead of making another;
the same key with another request is a 409 naming the header.

Keys live in the job store, so they hold across servers sharing it. A key is scoped to the
caller's credentials and the endpoint (stored only as a digest of the three); a request is
compared by a digest of what it asks for once parsed (a multipart body's raw bytes differ
on every retry: the client draws a new boundary).
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Awaitable, Callable

from fastapi import Request

from server.errors import APIError
from server.jobs.model import JobStore, VideoJob

HEADER = "Idempotency-Key"
MAX_KEY_CHARS = 255
# How long a retry waits for the first request with its key to record its video (that takes
# milliseconds; longer means the first is stuck or its server died, and the retry says so).
JOIN_WAIT_S = 10.0
# A first use that has recorded no video this long after its claim never will: its server
# died between the two, or recording failed. The key is then free again.
STALE_CLAIM_S = 60.0


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
    store: JobStore,
    key: str | None,
    request_digest: str,
    window_s: float,
    create: Callable[[], Awaitable[VideoJob]],
) -> VideoJob:
    """`create()` — unless a request with `key` came first: then its video."""
    if key is None:
        return await create()
    give_up = time.monotonic() + JOIN_WAIT_S
    while True:
        first = store.claim_key(key, request_digest, window_s, STALE_CLAIM_S)
        if first is None:  # this request is the first with the key
            try:
                job = await create()
            except BaseException:
                store.release_key(key)  # nothing was made: a retry may run it
                raise
            store.bind_key(key, job.id)
            return job
        if first.fingerprint != request_digest:
            raise APIError(
                409,
                f"this {HEADER} was first used with another request; send a new key for a new request",
                param=HEADER,
                code="idempotency_key_reused",
            )
        if first.video_id is not None:
            made = store.get(first.video_id)
            if made is None:
                raise APIError(
                    404,
                    f"the video this {HEADER} made ({first.video_id}) was deleted or has expired",
                    param=HEADER,
                    code="not_found",
                )
            return made
        if time.monotonic() > give_up:
            raise APIError(
                409,
                f"a request with this {HEADER} is still being processed; try again",
                param=HEADER,
                code="idempotency_key_in_use",
                retry=True,
            )
        await asyncio.sleep(0.05)  # the first is between recording the key and its video
