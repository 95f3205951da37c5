"""How many gateways serve on Ray Serve, as a setting of `ServeSettings` (a base it inherits,
so it is a flag and a YAML key like the rest). When several may: `server/ray_serve/gateways.py`."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class GatewaySettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    gateway_replicas: int = Field(
        1,
        ge=1,
        description="Ray Serve: gateway replicas (the HTTP routes in front of the engine "
        "replicas) behind Serve's proxy; more than one needs --database-url (PostgreSQL) and "
        "--output-url (a bucket), else one runs and the log says why",
    )
