"""What the Ray Serve deployments ask Ray for, and how the start waits for them, as settings
of `ServeSettings` (groups it inherits, so each is a flag and a YAML key like the rest).

Ray places a replica only on a node with its resources free, and Serve waits for such a
node without end, saying so only in `serve status`: the defaults fit a small machine (a
gateway asks for nothing, like Serve's own proxy), `diffbatch serve --ray-address` checks
them against the cluster before deploying (`server/ray_serve/placement.py`) and gives up
after `--ray-start-timeout-s` with Serve's reason.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator

from server.settings.section import Section

RAY_PLACEMENT_SECTION = "placing and starting on Ray Serve"


class ReplicaPlacementSettings(Section):
    """What one engine replica asks Ray for: a model of several may ask for its own."""

    help_section = RAY_PLACEMENT_SECTION
    each_model = True

    replica_cpus: float | None = Field(
        None,
        ge=0,
        allow_inf_nan=False,
        description="Ray Serve: CPUs each engine replica asks Ray for (where Ray may place it, not "
        "a limit; default: 1 with --device cpu, 0 on a GPU); with --cfg-parallel or "
        "--sequence-parallel, each worker's placement group bundle",
    )
    replica_gpus: float | None = Field(
        None,
        ge=0,
        allow_inf_nan=False,
        description="Ray Serve: GPUs each engine replica asks Ray for (default: --data-parallel-size "
        "on a GPU device, 0 with --device cpu; a fraction puts several replicas on one GPU); "
        "not with --cfg-parallel or --sequence-parallel, where each worker's bundle is one GPU",
    )


class RayStartSettings(Section):
    """What a gateway asks Ray for, and how the start checks and waits: the server's."""

    help_section = RAY_PLACEMENT_SECTION
    each_model = False

    gateway_cpus: float = Field(
        0.0,
        ge=0,
        allow_inf_nan=False,
        description="Ray Serve: CPUs each gateway asks Ray for; 0, like Serve's own proxy, fits "
        "beside the engine replicas on any node (give CPUs or --gateway-resources to keep it off "
        "a head that takes no work)",
    )
    gateway_resources: dict[str, float] = Field(
        default_factory=dict,
        description="Ray Serve: custom resources each gateway asks Ray for, NAME=AMOUNT each "
        "(diffbatch-gateway=1: only on nodes started with --resources offering it; default: "
        "none); repeatable",
        json_schema_extra={"metavar": "NAME=AMOUNT"},
    )
    ray_resource_check: Literal["refuse", "warn"] = Field(
        "refuse",
        description="Ray Serve: when the cluster's free resources cannot hold the deployments, "
        "refuse to start saying what cannot be placed, or warn and deploy anyway (a cluster "
        "that adds nodes on demand)",
    )
    ray_start_timeout_s: float = Field(
        1200.0,
        gt=0,
        allow_inf_nan=False,
        description="Ray Serve: how long the application may take to run (replicas placed and "
        "their models loaded) before the start gives up with Serve's reason; meanwhile the log "
        "relays what Serve says of each deployment",
    )

    @field_validator("gateway_resources", mode="before")
    @classmethod
    def _parse_resources(cls, value: Any) -> Any:
        """NAME=AMOUNT pairs from a flag (a list), a variable (comma-separated) or YAML (a
        mapping)."""
        if isinstance(value, str):
            value = [part for part in re.split(r"[,\s]+", value) if part]
        if isinstance(value, list | tuple):
            pairs = [str(item).partition("=") for item in value]
            if bad := [name for name, eq, amount in pairs if not (name and eq and amount)]:
                raise ValueError(f"expected NAME=AMOUNT pairs, got {', '.join(map(repr, bad))}")
            return {name: amount for name, _, amount in pairs}
        return value

    @field_validator("gateway_resources")
    @classmethod
    def _check_resources(cls, value: dict[str, float]) -> dict[str, float]:
        # CPU and GPU have flags of their own; Ray refuses them among the custom ones.
        if reserved := sorted({"CPU", "GPU"} & set(value)):
            raise ValueError(f"{', '.join(reserved)}: use --gateway-cpus (GPUs: none for a gateway)")
        if negative := sorted(name for name, amount in value.items() if amount < 0):
            raise ValueError(f"{', '.join(negative)}: an amount cannot be negative")
        return value
