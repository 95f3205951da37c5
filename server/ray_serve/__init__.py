"""diffbatch on Ray Serve: one gateway deployment (the same FastAPI app, routes, errors and
metrics as `diffbatch serve`) in front of N engine replicas, each an `AsyncEngine` with its
own batching on its own GPU, reached through a batch-key-aware request router.

Start it with `diffbatch serve --ray-address ADDRESS --replicas N` or
`serve run configs/ray-serve.yaml`. Needs the `[ray]` extra.
"""

from server.ray_serve.app import build_app

__all__ = ["build_app"]
