"""`diffbatch serve --ray-address ADDRESS`: deploy the application on a running Ray cluster,
serve it through Serve's HTTP proxy on --host/--port, and take it down again on SIGTERM or
Ctrl-C (the cluster itself stays up: it is not ours).

The start checks that the cluster can hold the deployments (`placement.py`), then waits for
the application to run with Serve's messages in the log (`start.py`). SIGTERM and Ctrl-C stop
it at any point, the start included: the handler raises `Stopped` in the main thread, which
is only ever in Ray calls that return or in short sleeps. A stop during the start kills the
replicas (none has served); a stop while serving lets Serve stop them gracefully. A second
signal while the application is being taken down ends the process at once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable
from types import FrameType
from typing import Literal

import ray
from ray import serve
from ray.exceptions import RayError
from ray.serve._private.common import ReplicaID
from ray.serve._private.constants import SERVE_NAMESPACE

from server.ray_serve.app import application, demands
from server.ray_serve.gateways import gateway_replicas
from server.ray_serve.placement import ClusterResources, unplaceable
from server.ray_serve.start import StartError, wait_until_running
from server.settings import ServeSettings

logger = logging.getLogger(__name__)

APP_NAME = "diffbatch"

# How far the start got: what there is to take down.
Stage = Literal["checking", "deploying", "serving"]
# How long a stop during the start kills the replicas before leaving them to Serve.
_END_REPLICAS_S = 30.0


class Stopped(BaseException):
    """SIGTERM or Ctrl-C (a BaseException, as KeyboardInterrupt: no `except Exception` in
    Ray or here swallows it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)


class StopSignals:
    """The first SIGTERM or SIGINT raises `Stopped` where the main thread is (while the
    application is taken down, it is noted instead); a second one while it is taken down
    ends the process at once."""

    def __init__(self) -> None:
        self._stopping = False
        self._taking_down = False

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)

    def taking_down(self) -> None:
        self._taking_down = True

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self._taking_down and self._stopping:
            logger.warning("%s again: leaving at once (Serve may still hold the application)", name)
            os._exit(128 + signum)
        if self._taking_down:  # after a failed start: it is stopping already
            logger.warning("%s: stopping already (again to leave at once)", name)
        if self._stopping or self._taking_down:
            self._stopping = True
            return
        self._stopping = True
        raise Stopped(signum)


def serve_on_ray(settings: ServeSettings) -> int:
    signals = StopSignals()
    signals.install()
    try:
        ray.init(address=settings.ray_address, log_to_driver=False)
        # Again: ray.init installs a SIGTERM handler of its own, which exits at once.
        signals.install()
        return _start_and_serve(settings, signals)
    except Stopped as stopped:  # while connecting: nothing to take down
        logger.info("%s: stopped", stopped)
        return 0


def _start_and_serve(settings: ServeSettings, signals: StopSignals) -> int:
    stage: Stage = "checking"
    try:
        check_placement(settings)
        stage = "deploying"
        _deploy(settings)
        stage = "serving"
        logger.info("serving %s", _what_runs(settings))
        while True:
            signal.pause()  # until a signal's handler raises Stopped
    except Stopped as stopped:
        logger.info("%s: stopping", stopped)
        return 0
    except StartError as failed:
        logger.error("%s", failed)
        return 1
    finally:
        signals.taking_down()
        _take_down(stage)


def check_placement(settings: ServeSettings) -> None:
    """StartError (or a warning, with `--ray-resource-check warn`) when the cluster's free
    resources surely cannot hold the deployments."""
    if APP_NAME in serve.status().applications:
        # Serve replaces its replicas, freeing what they hold: what is free now is not the test.
        logger.info("replacing the application %r already on the cluster", APP_NAME)
        return
    nodes = [node["Resources"] for node in ray.nodes() if node["Alive"]]  # type: ignore[no-untyped-call]
    free = ray.available_resources()  # type: ignore[no-untyped-call]
    verdict = unplaceable(demands(settings), ClusterResources(free, nodes))
    if verdict is None:
        return
    if settings.ray_resource_check == "refuse":
        raise StartError(verdict)
    logger.warning("%s; deploying anyway (--ray-resource-check warn)", verdict)


def _deploy(settings: ServeSettings) -> None:
    start_proxy(settings)
    target = serve.RunTarget(application(settings), name=APP_NAME, route_prefix=settings.root_path or "/")
    # Not Serve's own wait: it would hold the main thread until the application runs, if ever.
    serve.run_many([target], wait_for_ingress_deployment_creation=False, wait_for_applications_running=False)
    logger.info(
        "deploying on Ray Serve: waiting up to %g s for the application to run", settings.ray_start_timeout_s
    )
    wait_until_running(APP_NAME, settings.ray_start_timeout_s)


def start_proxy(settings: ServeSettings, start: Callable[..., object] = serve.start) -> None:
    """Serve's HTTP proxy on the settings' address; StartError, one line, when Ray gives up on
    it (on a busy node its ProxyActor can miss Ray's own start timeout and die), not the
    traceback Ray raises."""
    try:
        start(http_options={"host": settings.host, "port": settings.port})
    except RayError as failed:
        cause = str(failed).strip().splitlines()[0] if str(failed).strip() else "no reason given"
        raise StartError(
            f"Ray Serve's HTTP proxy did not start on {settings.host}:{settings.port} "
            f"({type(failed).__name__}: {cause})"
        ) from failed


def _what_runs(settings: ServeSettings) -> str:
    replicas = (
        str(settings.replicas)
        if settings.max_replicas is None
        else f"{settings.replicas}-{settings.max_replicas}"
    )
    return (
        f"{settings.model_name!r} on http://{settings.host}:{settings.port} through Ray Serve: "
        f"{gateway_replicas(settings)} gateways, {replicas} engine replicas, {settings.ray_router} router"
    )


def _take_down(stage: Stage) -> None:
    """Leave the cluster, after deleting the application and shutting Serve down if the
    start got that far; each step is tried even if one before it failed."""
    steps: list[tuple[str, Callable[[], object]]] = []
    if stage == "deploying":
        steps.append(("ending the replicas of the unfinished start", _end_replicas))
    if stage != "checking":
        steps += [
            ("deleting the application", lambda: serve.delete(APP_NAME)),
            ("shutting Serve down", serve.shutdown),
        ]
    for what, step in [*steps, ("leaving the Ray cluster", ray.shutdown)]:
        logger.info("stopping: %s", what)
        try:
            step()
        except Exception:  # the next step still runs
            logger.warning("stopping: %s failed", what, exc_info=True)


def _end_replicas() -> None:
    """Kill the replicas of an application that never ran, once Serve is deleting it, rather
    than wait for Serve to stop them gracefully: none has requests to finish, and Serve gives
    one that never started (no node could take it; or a gateway still in its constructor,
    waiting for an engine replica) its whole grace period. Killed earlier, while Serve still
    wants the application, they would be replaced."""
    serve.delete(APP_NAME, _blocking=False)
    give_up = time.monotonic() + _END_REPLICAS_S
    while (overview := serve.status().applications.get(APP_NAME)) is not None:
        if time.monotonic() > give_up:
            return  # Serve's own graceful stop finishes it
        if str(getattr(overview.status, "value", overview.status)) == "DELETING":
            for name in _replica_actors(APP_NAME):
                with contextlib.suppress(ValueError):  # it ended meanwhile
                    ray.kill(ray.get_actor(name, namespace=SERVE_NAMESPACE), no_restart=True)
        time.sleep(0.1)


def _replica_actors(app: str) -> list[str]:
    """The names of the application's replica actors (Serve names them by replica id)."""
    names = []
    for actor in ray.util.list_named_actors(all_namespaces=True):
        name = actor["name"]
        serve_replica = actor["namespace"] == SERVE_NAMESPACE and ReplicaID.is_full_id_str(name)
        if serve_replica and ReplicaID.from_full_id_str(name).deployment_id.app_name == app:
            names.append(name)
    return names
