"""diffbatch on Ray Serve: one gateway deployment (the same FastAPI app, routes, errors and
metrics as `diffbatch serve`) in front of N engine replicas, each an `AsyncEngine` with its
own batching on its own GPU, reached through a batch-key-aware request router.

Start it with `diffbatch serve --ray-address ADDRESS --replicas N` or
`serve run configs/ray-serve.yaml`. Needs the `[ray]` extra.

`build_app` is imported on first use, so that `server.ray_serve.messages` (plain values the
local API processes reuse, `server.api_servers`) imports without Ray.
"""

from __future__ import annotations

from typing import Any

__all__ = ["build_app"]


def __getattr__(name: str) -> Any:
    if name == "build_app":
        from server.ray_serve.app import build_app

        return build_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
