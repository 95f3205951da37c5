"""A child's lifeline to its supervisor: a pipe the supervisor writes "stop" on, or whose end
closes when the supervisor dies (even by SIGKILL). Either way the child stops, so no engine
process or API process outlives the server it belonged to. Read in a thread of its own."""

from __future__ import annotations

import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any


def watch_lifeline(
    lifeline: Connection, stop: Callable[[], Any], orphaned: Callable[[], Any] | None = None
) -> None:
    """Call `stop` (in the watching thread) once the supervisor says so or is gone; where
    `orphaned` is given, that instead when it is gone (it ordered nothing: see the engine
    process)."""

    def watch() -> None:
        try:
            while lifeline.recv() != "stop":
                pass
        except (EOFError, OSError):  # the supervisor is gone
            (orphaned or stop)()
            return
        stop()

    threading.Thread(target=watch, name="diffbatch-lifeline", daemon=True).start()
