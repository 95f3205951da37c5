"""`diffbatch serve --ray-address ADDRESS`: deploy the application on a running Ray cluster,
serve it through Serve's HTTP proxy on --host/--port, and take it down again on SIGTERM or
Ctrl-C (the cluster itself stays up: it is not ours)."""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType

import ray
from ray import serve

from server.ray_serve.app import application
from server.ray_serve.gateways import gateway_replicas
from server.settings import ServeSettings

logger = logging.getLogger(__name__)

APP_NAME = "diffbatch"


def serve_on_ray(settings: ServeSettings) -> int:
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    ray.init(address=settings.ray_address, log_to_driver=False)
    # After ray.init, which installs handlers of its own that end the process at once.
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        serve.start(http_options={"host": settings.host, "port": settings.port})
        serve.run(application(settings), name=APP_NAME, route_prefix=settings.root_path or "/")
        logger.info(
            "serving %r on http://%s:%d through Ray Serve: %d gateways, %s engine replicas, %s router",
            settings.model_name,
            settings.host,
            settings.port,
            gateway_replicas(settings),
            settings.replicas
            if settings.max_replicas is None
            else f"{settings.replicas}-{settings.max_replicas}",
            settings.ray_router,
        )
        stop.wait()
        logger.info("stopping: deleting the application")
    finally:
        try:
            serve.delete(APP_NAME)
            serve.shutdown()  # type: ignore[no-untyped-call]
        finally:
            ray.shutdown()
    return 0
