"""The names of the engine deployments, which the application deploys (`app.py`) and the
gateway's engine watches (`gateway_engine.py`): one `EngineReplica`, or with several models
one per model."""

from __future__ import annotations

from server.settings import deployment_suffix

REPLICAS = "EngineReplica"


def deployment_name(model: str) -> str:
    """The engine deployment of one of several models (letters, digits, '_' and '-')."""
    return f"{REPLICAS}-{deployment_suffix(model)}"
