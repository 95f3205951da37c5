"""The residency settings of a server of several models (a base `ServeSettings` inherits):
how much host memory idle models may be parked in, rather than dropped."""

from __future__ import annotations

from pydantic import BaseModel, Field


class ResidencySettings(BaseModel):
    models_host_memory_mb: float | None = Field(
        None,
        gt=0,
        allow_inf_nan=False,
        description="with several models: most MiB of weights parked in host memory; a model "
        "unloaded to make room on the device moves there (its engine stays up) and comes back "
        "on its next request faster than a load, unless it uses offload or quantized weights "
        "or a worker process (then it is dropped) (default: none, unloaded models are dropped)",
    )

    def host_budget_bytes(self) -> int | None:
        mb = self.models_host_memory_mb
        return None if mb is None else int(mb * 2**20)
