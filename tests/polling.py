"""Waiting for a state instead of sleeping for a guess: tests stay green on a busy machine."""

from __future__ import annotations

import asyncio
import inspect
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

# Only a guard against a hang: a condition that holds returns at once, however slow the machine.
HANG_GUARD_S = 60.0


async def until(
    condition: Callable[[], bool | Awaitable[bool]], what: str, timeout_s: float = HANG_GUARD_S
) -> None:
    """Let the event loop run until `condition` (sync or async) holds."""
    give_up = time.monotonic() + timeout_s
    while True:
        held = condition()
        if inspect.isawaitable(held):
            held = await held
        if held:
            return
        if time.monotonic() > give_up:
            raise AssertionError(f"never happened: {what}")
        await asyncio.sleep(0.005)


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 2 * HANG_GUARD_S) -> None:
    """Block (a thread, not an event loop) until `condition` holds; end-to-end tests wait on
    other processes (a worker restarting, a Ray replica), so the guard is longer."""
    give_up = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > give_up:
            raise AssertionError(f"never happened: {what}")
        time.sleep(0.02)


def wait_while_load_held(gate: Path) -> None:
    """In a test pipeline's load: if `<gate>.hold-load` exists, create `<gate>.loading-<pid>`
    (the test sees the load has begun) and wait until the test removes the hold."""
    hold = gate.with_suffix(".hold-load")
    if hold.exists():
        gate.with_suffix(f".loading-{os.getpid()}").touch()
        wait_for(lambda: not hold.exists(), "the test releases the load", timeout_s=600)
