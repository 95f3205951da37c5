"""Waiting for a state instead of sleeping for a guess: tests stay green on a busy machine."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable

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
