"""`BatchKeyRouter`: Ray Serve's request router for the engine replicas, batch-key aware.

Requests with the same batch key (the step key in step mode) go to the same replica while
it has room, so they share its forwards; a key seen for the first time goes to the least
loaded replica (of those, the one home to the fewest keys); when a key's replica is full,
to the least loaded of the others. Ray's default router (power of two choices) spreads
compatible requests over every replica, so batches are smaller (docs/benchmarks.md,
"Ray Serve router").

One router lives in each process that holds a handle to the replicas: here the gateway.
Whichever router runs (`--ray-router`), it posts the replicas' routing stats (their
engines' waiting and running counts) on `ROUTING_BOARD` for the gateway's /metrics.
"""

from __future__ import annotations

from typing import Any

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from engine.request import BatchKey

# A module, not its board: Serve pickles this module by value into each handle, and the
# board must be the gateway's own (a module is pickled by reference).
from server.ray_serve import watch

# Keys whose home replica is remembered (sizes x steps x guidance ... can be many).
_MAX_KEYS = 4096


def batch_key_of(request: PendingRequest | None) -> BatchKey | None:
    if request is None:
        return None
    for value in (*request.args, *request.kwargs.values()):
        key = getattr(value, "batch_key", None)
        if key is not None:
            return tuple(key)
    return None


def post_routing_stats(router: RequestRouter, replicas: list[RunningReplica]) -> None:
    """Serve hands a router the running replicas, with their routing stats, whenever either
    changes: the gateway reads them from the board."""
    # Serve's router names its deployment only privately (`app_name` is public); the
    # replicas name it too, but there may be none.
    deployment = router._deployment_id.name
    stats = {r.replica_id.unique_id: r.routing_stats for r in replicas}
    watch.ROUTING_BOARD.post(router.app_name, deployment, stats)


class DefaultRouter(PowerOfTwoChoicesRequestRouter):
    """Ray's default router (power of two choices), posting the routing stats too."""

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        post_routing_stats(self, replicas)


class BatchKeyRouter(RequestRouter):
    def initialize_state(self, room: int = 8, **kwargs: Any) -> None:
        """`room`: requests a replica may hold before compatible ones overflow elsewhere
        (the deployment passes max_num_seqs)."""
        self._room = room
        self._home: dict[BatchKey, ReplicaID] = {}
        # Requests this router sent that have not completed, per replica: the replica's own
        # queue length reaches the router late, a burst must not all go to one replica.
        self._in_flight: dict[ReplicaID, int] = {}

    def _load(self, replica: RunningReplica) -> int:
        cached = self.replica_queue_len_cache.get(replica.replica_id) or 0
        return max(cached, self._in_flight.get(replica.replica_id, 0))

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        if pending_request is not None:
            # Without it Serve retries a round where every replica is full at once.
            pending_request.routing_context.should_backoff = True
        key = batch_key_of(pending_request)
        least_loaded = sorted(candidate_replicas, key=lambda r: (self._load(r), r.replica_id.unique_id))
        if key is None:
            return [least_loaded]
        by_id = {replica.replica_id: replica for replica in candidate_replicas}
        home = by_id.get(self._home.get(key))  # type: ignore[arg-type]
        if home is None:  # a new key, or its replica is gone
            homes = list(self._home.values())
            home = min(least_loaded, key=lambda r: (self._load(r), homes.count(r.replica_id)))
            self._home.pop(key, None)
            self._home[key] = home.replica_id
            if len(self._home) > _MAX_KEYS:  # the oldest key forgets its home
                del self._home[next(iter(self._home))]
        others = [replica for replica in least_loaded if replica is not home]
        ranks = [[home]] if self._load(home) < self._room else []
        if others:
            ranks.append(others)  # Serve takes the shortest queue of a rank
        ranks.append([home])  # over its room, it may still accept
        return ranks

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        post_routing_stats(self, replicas)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        self._in_flight[replica_id] = self._in_flight.get(replica_id, 0) + 1

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        # Also called for requests a full replica refused (never routed): never below 0.
        self._in_flight[replica_id] = max(0, self._in_flight.get(replica_id, 0) - 1)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._in_flight.pop(replica_id, None)
        for key in [key for key, home in self._home.items() if home == replica_id]:
            del self._home[key]
