"""Asserting that requests shared a denoiser forward, from the server's own counters: a test
that says requests share steps must fail if the server ran them one after another."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from tests.e2e.conftest import Server

T = TypeVar("T")

# Requests sent together share a step unless the machine is so busy that one finished before
# the next arrived (step mode waits for no company): that is retried, never passed.
ATTEMPTS = 3


def shared_forwards(server: Server) -> float:
    """Denoiser forwards so far that carried more than one request."""
    return server.metric("diffbatch_batch_size_count") - server.metric(
        'diffbatch_batch_size_bucket{le="1.0"}'
    )


def mixed_size_forwards(server: Server) -> float:
    """Denoiser forwards so far that carried requests of more than one size."""
    return server.metric("diffbatch_step_sizes_count") - server.metric(
        'diffbatch_step_sizes_bucket{le="1.0"}'
    )


def sent_together(
    server: Server, send: Callable[[], T], shared: Callable[[Server], float] = shared_forwards
) -> T:
    """`send()`'s result, once a call of it made at least one forward carry several requests
    (by the count `shared`: several requests, or several sizes)."""
    for _ in range(ATTEMPTS):
        before = shared(server)
        result = send()
        if shared(server) > before:
            return result
    raise AssertionError(f"requests sent together never shared a forward in {ATTEMPTS} attempts")
