"""The Ray Serve application: `Gateway` (ingress, one replica) and `EngineReplica` (N).

`build_app(args)` is what `serve run server.ray_serve:build_app key=value ...` and the
`configs/ray-serve.yaml` Serve config call; `diffbatch serve --ray-address` calls
`application(settings)` directly.

Where things live: the gateway owns the HTTP routes, the image URL store and the video
job table and files, so every video call works whichever engine replica made the video.
It is one replica (it does little work: admission, encoding), or `--gateway-replicas`
when the job table is in PostgreSQL and the files in a bucket (`gateways.py`). The engine
replicas hold the models.

Secrets: what a deployment is bound with, Ray stores in its GCS and shows on its dashboard,
so no deployment is given the API key. The replicas do not need it; the gateway reads it
from its own key file (`api_key_file`: a path) or its own `DIFFBATCH_API_KEY`. The webhook
signing secret likewise: only the gateway sends webhooks, reading it from its own
`DIFFBATCH_WEBHOOK_SECRET`; the replicas get no webhook settings at all. A database
password is refused in `--database-url` for the same reason (PGPASSWORD or .pgpass instead).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from ray import serve
from ray.serve import Application
from ray.serve.config import AutoscalingConfig, RequestRouterConfig
from ray.serve.handle import DeploymentHandle
from starlette.types import ASGIApp

from server.ray_serve.deployments import REPLICAS, deployment_name
from server.ray_serve.gateways import GatewayHeader, check_shareable, gateway_replicas, warn_if_clamped
from server.ray_serve.multiplexed import MultiplexedReplica
from server.ray_serve.placement import (
    LANE_STRATEGY,
    Demand,
    actor_options,
    gateway_resources,
    replica_bundles,
    replica_resources,
)
from server.ray_serve.replica import EngineReplica
from server.ray_serve.router import BatchKeyRouter, DefaultRouter
from server.ray_serve.watch import ROUTING_STATS_PERIOD_S
from server.settings import ENV_PREFIX, ServeSettings, SettingsError, load_settings

GATEWAY = "Gateway"
API_KEY_VARIABLE = f"{ENV_PREFIX}API_KEY"
WEBHOOK_SECRET_VARIABLE = f"{ENV_PREFIX}WEBHOOK_SECRET"
# What only the gateway uses (it runs the video jobs' webhooks).
_WEBHOOK_FIELDS = {"webhook_url", "webhook_secret", "allowed_webhook_hosts"}
# How often a stopping replica looks whether its requests are done. Serve's default (2 s)
# is a sleep before the first look, so every stop (the application deleted, scaled down)
# took 2 s or more even with nothing to finish; the look itself is a counter read.
DRAIN_POLL_S = 0.2
# How often Serve's controller checks each replica: it learns of a replica's death (its
# process killed, its node gone) only so, and starts the replacement then. Serve's default
# (10 s) left a dead replica unreplaced for up to that long; the check is an empty call.
HEALTH_CHECK_PERIOD_S = 2.0


class Gateway:
    """The same FastAPI app as `diffbatch serve`, over the engine replicas: one deployment,
    or with several models one deployment per model (`replicas` by model name)."""

    def __init__(
        self,
        settings: dict[str, Any],
        replicas: DeploymentHandle[Any] | dict[str, DeploymentHandle[Any]],
        api_key_required: bool = False,
    ) -> None:
        self._settings = gateway_settings(settings, api_key_required, os.environ)
        self._replicas = replicas
        context = serve.get_replica_context()
        check_shareable(self._settings, context.world_size or 1)  # None while autoscaling
        warn_if_clamped(self._settings)  # in this gateway's own log too, where operators look
        self._app_name = context.app_name
        self._gateway_id = context.replica_id.unique_id

    def __serve_build_asgi_app__(self) -> ASGIApp:
        from server.app import create_app
        from server.ray_serve.gateway_engine import gateway_engine

        settings = self._settings
        engine = gateway_engine(settings, self._replicas, self._app_name)
        app = create_app(settings, engine)
        app.add_middleware(GatewayHeader, gateway_id=self._gateway_id)
        return app


def gateway_settings(
    values: Mapping[str, Any], api_key_required: bool, environ: Mapping[str, str]
) -> ServeSettings:
    """The gateway's settings: those it was bound with (no secret among them), and the API
    key from its key file (read by `ServeSettings`) or else its own environment. A key was
    set where the application was built but this gateway finds none: it refuses to start
    rather than serve without one."""
    values = dict(values)
    if values.get("api_key_file") is None and environ.get(API_KEY_VARIABLE, "").strip():
        values["api_key"] = environ[API_KEY_VARIABLE]
    # A request's own webhook_url is signed with its key's webhook_secret (from the key file).
    if values.get("webhook_url"):
        if not environ.get(WEBHOOK_SECRET_VARIABLE, "").strip():
            raise SettingsError(
                f"webhooks are set, but the gateway has no signing secret: give it as "
                f"{WEBHOOK_SECRET_VARIABLE} in the Ray cluster's environment (a secret given as a "
                "value is not sent to the gateway, as Ray would store it with the deployment)"
            )
        values["webhook_secret"] = environ[WEBHOOK_SECRET_VARIABLE]
    settings = ServeSettings(**values)
    if api_key_required and settings.api_key is None:
        raise SettingsError(
            "an API key is set, but the gateway cannot read it: with Ray Serve give it as "
            f"api_key_file (a path the gateway's node can read) or as {API_KEY_VARIABLE} in the "
            "Ray cluster's environment; a key given as a value is not sent to the gateway, as Ray "
            "would store it in plain text with the deployment"
        )
    return settings


def replica_options(settings: ServeSettings, name: str = REPLICAS) -> dict[str, Any]:
    """How Serve runs the engine replicas: one device each (`--replica-cpus`, `--replica-gpus`),
    autoscaled on ongoing requests when `--max-replicas` is above `--replicas`, load shed past
    `--max-queue-len`."""
    options: dict[str, Any] = {
        "name": name,
        # An engine takes many requests at once: it batches them.
        "max_ongoing_requests": max(2 * settings.max_num_seqs, 16),
        "max_queued_requests": settings.max_queue_len,
        "ray_actor_options": actor_options(replica_resources(settings)),
        "graceful_shutdown_timeout_s": settings.shutdown_timeout_s,
        "graceful_shutdown_wait_loop_s": DRAIN_POLL_S,
        "health_check_period_s": HEALTH_CHECK_PERIOD_S,
    }
    if (bundles := replica_bundles(settings)) is not None:
        # Lanes of several devices: a placement group per replica, which Serve creates with
        # the replica and removes with it; the replica runs in (and uses up) its first bundle.
        options["placement_group_bundles"] = bundles
        options["placement_group_strategy"] = LANE_STRATEGY
        options["ray_actor_options"] = actor_options(bundles[0])
    router = BatchKeyRouter if settings.ray_router == "batch-key" else DefaultRouter
    routing: dict[str, Any] = {  # (its pydantic fields confuse mypy: typed here instead)
        "request_router_class": f"{router.__module__}:{router.__name__}",
        "request_router_kwargs": {"room": settings.max_num_seqs} if router is BatchKeyRouter else {},
        "request_routing_stats_period_s": ROUTING_STATS_PERIOD_S,
    }
    options["request_router_config"] = RequestRouterConfig(**routing)
    if settings.max_replicas is not None and settings.max_replicas > settings.replicas:
        options["autoscaling_config"] = AutoscalingConfig(
            min_replicas=settings.replicas,
            max_replicas=settings.max_replicas,
            target_ongoing_requests=settings.max_num_seqs,
        )
    else:
        options["num_replicas"] = settings.replicas
    return options


def application(settings: ServeSettings) -> Application:
    """The gateway over one engine deployment, or with several models one per model (each
    its own replicas, autoscaling and router, from that model's settings), or with
    `--ray-models-per-replica` one deployment multiplexing them all."""
    check_no_bound_secrets(settings)
    warn_if_clamped(settings)
    gateway_values = settings.model_dump(mode="json", exclude={"api_key", "webhook_secret"})
    deployment: Any = serve.deployment  # its overloads do not tell a class from options
    replicas: Any
    if settings.models and settings.ray_models_per_replica is not None:
        replicas = _multiplexed_deployment(settings)
    elif settings.models:
        replicas = {
            e.name: _engine_deployment(settings.for_entry(e), deployment_name(e.name))
            for e in settings.models
        }
    else:
        replicas = _engine_deployment(settings, REPLICAS)
    gateway = deployment(serve.ingress()(Gateway)).options(
        name=GATEWAY,
        num_replicas=gateway_replicas(settings),
        max_ongoing_requests=settings.max_queue_len,
        ray_actor_options=actor_options(gateway_resources(settings)),
        graceful_shutdown_wait_loop_s=DRAIN_POLL_S,
        health_check_period_s=HEALTH_CHECK_PERIOD_S,
    )
    app: Application = gateway.bind(gateway_values, replicas, settings.api_key is not None)
    return app


def demands(settings: ServeSettings) -> list[Demand]:
    """What `application(settings)` asks Ray for, deployment by deployment (an autoscaled
    one starts with `--replicas`)."""
    if settings.models and settings.ray_models_per_replica is None:
        engines = [(deployment_name(e.name), settings.for_entry(e)) for e in settings.models]
    else:
        engines = [(REPLICAS, settings)]
    wanted = [Demand(name, settings.replicas, replica_resources(each)) for name, each in engines]
    return [*wanted, Demand(GATEWAY, gateway_replicas(settings), gateway_resources(settings))]


def _engine_deployment(settings: ServeSettings, name: str) -> Application:
    # Each deployment rebuilds the settings from these (see the module's "Secrets").
    values = settings.model_dump(mode="json", exclude={"api_key", "api_key_file", *_WEBHOOK_FIELDS})
    deployment: Any = serve.deployment
    bound: Application = deployment(EngineReplica).options(**replica_options(settings, name)).bind(values)
    return bound


def _multiplexed_deployment(settings: ServeSettings) -> Application:
    # Its replicas' resources are the server's settings', whichever models they load.
    if lanes := [e.name for e in settings.models if settings.for_entry(e).lane_shape.size > 1]:
        raise SettingsError(
            f"--ray-models-per-replica cannot serve {', '.join(lanes)} with lanes of several devices "
            "(--cfg-parallel, --sequence-parallel) yet: serve them as a deployment per model"
        )
    values = settings.model_dump(mode="json", exclude={"api_key", "api_key_file", *_WEBHOOK_FIELDS})
    # Serve's default router: only it sends a model's requests where that model is loaded.
    options = replica_options(settings.model_copy(update={"ray_router": "default"}), REPLICAS)
    deployment: Any = serve.deployment
    bound: Application = deployment(MultiplexedReplica).options(**options).bind(values)
    return bound


def check_no_bound_secrets(settings: ServeSettings) -> None:
    """SettingsError for a password inside --database-url: the deployments are bound with
    the settings, which Ray keeps in its GCS and shows on its dashboard."""
    url = settings.database_url
    if url is not None and urlsplit(url).password is not None:
        raise SettingsError(
            "--database-url holds a password, which Ray Serve would store and show with the "
            "deployment's settings: leave it out of the URL and give it to the gateway hosts "
            "through PGPASSWORD or a .pgpass file"
        )


def build_app(args: dict[str, Any]) -> Application:
    """`serve run server.ray_serve:build_app config=configs/tiny-sd.yaml replicas=2`: any
    serve setting by name (a preset with `config`), over DIFFBATCH_* variables."""
    values = dict(args)
    config = values.pop("config", None)
    return application(load_settings(Path(config) if config else None, values, os.environ))
