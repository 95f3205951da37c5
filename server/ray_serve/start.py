"""Waiting for the application to run on Ray Serve, with Serve's word on each deployment
relayed to the log (why a replica waits — no node with its resources free, a slow or failed
constructor — Serve says only in `serve status`), until it runs, fails, or the start times out.

The wait is a loop of short calls and sleeps in the caller's thread, so a signal handler
that raises (`launch.py`) ends it wherever it is.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from ray import serve
from ray.serve.schema import ApplicationStatusOverview, ServeStatus

logger = logging.getLogger(__name__)

POLL_PERIOD_S = 1.0


class StartError(Exception):
    """The application did not come to run; the message says why, in Serve's words."""


def wait_until_running(
    app: str,
    timeout_s: float,
    read_status: Callable[[], ServeStatus] = serve.status,
    *,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    period_s: float = POLL_PERIOD_S,
) -> None:
    """Return once Serve says `app` is RUNNING; StartError when it fails to deploy or is
    still not running after `timeout_s`."""
    deadline = clock() + timeout_s
    relay = Relay(app)
    while True:
        overview = relay.read(read_status)
        if overview is not None:
            status = _value(overview.status)
            if status == "RUNNING":
                return
            if status == "DEPLOY_FAILED":
                raise StartError(f"Serve could not deploy the application: {overview.message or status}")
        if clock() >= deadline:
            raise StartError(
                f"the application is not running after {timeout_s:g} s (--ray-start-timeout-s): "
                f"{waiting_for(overview)}"
            )
        sleep(period_s)


def waiting_for(overview: ApplicationStatusOverview | None) -> str:
    """What keeps the application from running: each deployment not yet healthy, its
    replicas' states and Serve's message about it."""
    if overview is None:
        return "Serve does not list it yet"
    parts = [
        f"{name} {_value(d.status).lower()} ({_counts(d.replica_states)}): "
        f"{_one_line(d.message) or 'Serve gives no reason'}"
        for name, d in sorted(overview.deployments.items())
        if _value(d.status) != "HEALTHY"
    ]
    return "; ".join(parts) or _one_line(overview.message) or _value(overview.status).lower()


class Relay:
    """Logs each change in what Serve says of the application's deployments: their status,
    their replicas' states, their message (a warning when it has one: Serve's reasons)."""

    def __init__(self, app: str) -> None:
        self._app = app
        self._said: dict[str, tuple[str, str, str]] = {}
        self._failing = False

    def read(self, read_status: Callable[[], ServeStatus]) -> ApplicationStatusOverview | None:
        """The application as Serve reports it now (None until Serve lists it, or while Serve
        cannot be read: logged once a streak), its changes logged."""
        try:
            overview = read_status().applications.get(self._app)
        except Exception:  # a controller busy or restarting: read again
            if not self._failing:
                logger.warning("cannot read the application's status from Serve", exc_info=True)
            self._failing = True
            return None
        self._failing = False
        if overview is not None:
            self.log(overview)
        return overview

    def log(self, overview: ApplicationStatusOverview) -> None:
        for name, deployment in sorted(overview.deployments.items()):
            said = (
                _value(deployment.status),
                _counts(deployment.replica_states),
                _one_line(deployment.message or ""),
            )
            if self._said.get(name) == said:
                continue
            self._said[name] = said
            status, counts, message = said
            if message:
                logger.warning("Serve: %s %s (%s): %s", name, status.lower(), counts, message)
            else:
                logger.info("Serve: %s %s (%s)", name, status.lower(), counts)


def _counts(replica_states: Any) -> str:
    counts = {_value(state): n for state, n in dict(replica_states).items() if n}
    return ", ".join(f"{n} {state.lower()}" for state, n in sorted(counts.items())) or "no replicas yet"


def _value(status: Any) -> str:
    """Enums in Ray's types, plain strings as `serve.status()` may return them."""
    return str(getattr(status, "value", status))


def _one_line(text: str) -> str:
    return " ".join(text.split())
