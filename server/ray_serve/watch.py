"""`ReplicaWatch`: what the gateway knows of the engine replicas, for /health and /metrics.

Their states are Serve's controller's (`serve.status()`, read every `STATUS_PERIOD_S` in a
thread: the call blocks): while none is RUNNING (all killed, crash-looping, still loading),
`/health` is 503 with the reason. Their waiting requests are what each replica publishes
with `record_routing_stats`: Serve's controller pulls it every `ROUTING_STATS_PERIOD_S` and
hands it to the deployment's request routers, which post it on `ROUTING_BOARD`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ray import serve
from ray.serve.schema import ServeStatus

logger = logging.getLogger(__name__)

STATUS_PERIOD_S = 1.0
# Serve's default (10 s) would leave the waiting gauge that far behind.
ROUTING_STATS_PERIOD_S = 1.0


class RoutingBoard:
    """The latest routing stats of each engine replica, per deployment (an application of
    several models has one engine deployment per model: their stats must not mix), as the
    request routers received them. Process-wide because Ray builds the routers itself (inside
    each deployment handle, on its own event loop thread): the gateway cannot hand them an
    object."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats: dict[tuple[str, str], dict[str, Mapping[str, Any]]] = {}

    def post(self, app: str, deployment: str, stats: Mapping[str, Mapping[str, Any]]) -> None:
        """`stats`: replica id → what its `record_routing_stats` returned, for every running
        replica of the deployment (a replica that left is dropped)."""
        with self._lock:
            self._stats[app, deployment] = dict(stats)

    def waiting(self, app: str, deployment: str) -> int:
        with self._lock:
            replicas = list(self._stats.get((app, deployment), {}).values())
        return sum(int(stats.get("waiting", 0)) for stats in replicas)


ROUTING_BOARD = RoutingBoard()


@dataclass(frozen=True, slots=True)
class ReplicaStates:
    """The engine deployment as Serve reports it: replicas per state (RUNNING, STARTING,
    ...) and the deployment's status (HEALTHY, UNHEALTHY, DEPLOY_FAILED, ...)."""

    counts: Mapping[str, int]
    status: str

    @property
    def running(self) -> int:
        return self.counts.get("RUNNING", 0)

    @property
    def unavailable(self) -> str | None:
        """Why no request can run just now, or None while a replica runs. Says states only:
        Serve's message can hold a replica's traceback, which is logged, not sent."""
        if self.running:
            return None
        others = ", ".join(f"{n} {state.lower()}" for state, n in sorted(self.counts.items()) if n)
        return f"no engine replica is running ({others or 'none'}; deployment {self.status.lower()})"


def states_of(status: ServeStatus, app: str, deployment: str) -> tuple[ReplicaStates, str] | None:
    """The deployment's states and Serve's message about it, or None if Serve does not know
    it (the application is being deployed or deleted)."""
    application = status.applications.get(app)
    overview = application.deployments.get(deployment) if application is not None else None
    if overview is None:
        return None
    # Enums in Ray's types, plain strings as `serve.status()` returns them.
    counts = {str(getattr(state, "value", state)): n for state, n in overview.replica_states.items()}
    return ReplicaStates(counts, str(getattr(overview.status, "value", overview.status))), overview.message


class ReplicaWatch:
    def __init__(
        self,
        app: str,
        deployment: str,
        read_status: Callable[[], ServeStatus] = serve.status,
        board: RoutingBoard = ROUTING_BOARD,
        period_s: float = STATUS_PERIOD_S,
    ) -> None:
        self.states: ReplicaStates | None = None  # unknown until Serve answers
        self._app, self._deployment = app, deployment
        self._read_status, self._board, self._period_s = read_status, board, period_s
        self._task: asyncio.Task[None] | None = None
        self._users = 0  # engines that started it and have not stopped it
        self._failing = False

    async def start(self) -> None:
        """Start polling; a watch shared by the engines of several models (multiplexed on one
        deployment) polls once, until the last of them stops it."""
        self._users += 1
        if self._users > 1:
            return
        await self.refresh()
        self._task = asyncio.get_running_loop().create_task(self._poll(), name="diffbatch-replica-watch")

    async def stop(self) -> None:
        self._users -= 1
        if self._users > 0:
            return
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def refresh(self) -> None:
        """Read Serve's states once; on failure keep the last ones (logged once a streak)."""
        try:
            status = await asyncio.to_thread(self._read_status)
            found = states_of(status, self._app, self._deployment)
        except Exception:  # a watch never takes the gateway down
            if not self._failing:
                logger.warning("cannot read the engine replicas' states from Serve", exc_info=True)
            self._failing = True
            return
        self._failing = False
        if found is None:
            return
        states, message = found
        before = self.unavailable
        self.states = states
        if states.unavailable != before and states.unavailable is not None:
            logger.warning("%s. Serve says: %s", states.unavailable, message or "nothing")
        elif before is not None and states.unavailable is None:
            logger.info("engine replicas running again: %d", states.running)

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self._period_s)
            await self.refresh()

    @property
    def unavailable(self) -> str | None:
        return self.states.unavailable if self.states is not None else None

    @property
    def running(self) -> int:
        return self.states.running if self.states is not None else 0

    @property
    def waiting(self) -> int:
        """Requests waiting in the replicas' engines, as of their last routing stats."""
        return self._board.waiting(self._app, self._deployment)
