"""The gateway's engine: what its routes submit to, over the engine deployments — one
`RemoteEngine` over one deployment, or with several models a `ModelSet` of them (one
deployment per model, or one multiplexed deployment that every model shares)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from ray import serve
from ray.serve.handle import DeploymentHandle
from ray.serve.schema import ServeStatus

from engine.core.service import EngineService
from engine.models.model_set import ModelSet, ModelSlot
from server.ray_serve.deployments import REPLICAS, deployment_name
from server.ray_serve.remote_engine import RemoteEngine
from server.ray_serve.watch import ROUTING_BOARD, ReplicaWatch, RoutingBoard
from server.settings import ServeSettings


def gateway_engine(
    settings: ServeSettings,
    replicas: DeploymentHandle[Any] | dict[str, DeploymentHandle[Any]],
    app: str,
    read_status: Callable[[], ServeStatus] = serve.status,
    board: RoutingBoard = ROUTING_BOARD,
) -> EngineService:
    def watch(deployment: str) -> ReplicaWatch:
        return ReplicaWatch(app, deployment, read_status, board)

    if not settings.models:
        assert not isinstance(replicas, dict)
        return RemoteEngine(replicas, settings, watch(REPLICAS))
    if not isinstance(replicas, dict):  # multiplexed: one deployment
        # One watch of the shared replicas: the model set counts them once, not per model.
        shared = watch(REPLICAS)

        def share(name: str, own: ServeSettings) -> EngineService:
            # Serve routes it to a replica that has the model loaded (or loads it there).
            return RemoteEngine(replicas.options(multiplexed_model_id=name), own, shared)

        # Loaded on first use, on some replica; a replica may unload it again later.
        slots = [
            ModelSlot(e.name, functools.partial(share, e.name, settings.for_entry(e)), preload=e.preload)
            for e in settings.models
        ]
        return ModelSet(slots, shared_replicas=shared)

    def make(name: str, own: ServeSettings) -> EngineService:
        return RemoteEngine(replicas[name], own, watch(deployment_name(name)))

    # Each model's deployment holds it for good (Serve places, scales and restarts its
    # replicas): no memory budget here, and every model is loaded from the start.
    slots = [
        ModelSlot(e.name, functools.partial(make, e.name, settings.for_entry(e)), preload=True)
        for e in settings.models
    ]
    return ModelSet(slots)
