"""The residency settings of a server of several models (a base `ServeSettings` inherits):
how much host memory idle models may be parked in, rather than dropped; and the device
budget the models share, when `--models-memory-mb` does not say it."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from pydantic import BaseModel, Field

if TYPE_CHECKING:
    from server.settings import ServeSettings


class ResidencySettings(BaseModel):
    models_host_memory_mb: float | None = Field(
        None,
        gt=0,
        allow_inf_nan=False,
        description="with several models: most MiB of weights parked in host memory; a model "
        "unloaded to make room on the device moves there (its engine stays up) and comes back "
        "on its next request faster than a load, unless it uses offload or quantized weights "
        "or a worker process (then it is dropped); on the CPU both budgets are the same memory "
        "(default: none, unloaded models are dropped)",
    )

    def host_budget_bytes(self) -> int | None:
        mb = self.models_host_memory_mb
        return None if mb is None else int(mb * 2**20)


def models_budget_bytes(
    settings: ServeSettings, device_total: Callable[[str], int | None] | None = None
) -> int | None:
    """The bytes of weights the loaded models may hold: `--models-memory-mb`; else, when
    `--gpu-memory-utilization` is given and the models' device is a CUDA device here, that
    share of its memory; else no limit (the CPU's memory is the host's: nothing to size it by)."""
    if settings.models_memory_mb is not None:
        return int(settings.models_memory_mb * 2**20)
    if "gpu_memory_utilization" not in settings.model_fields_set:
        return None
    if device_total is None:
        from pipelines.memory.gauge import device_total_bytes  # torch, only when asked

        device_total = device_total_bytes
    total = device_total(settings.device.split(",")[0].strip())
    return None if total is None else int(total * settings.gpu_memory_utilization)
