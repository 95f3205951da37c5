"""TaylorSeer's settings of `ServeSettings` (through `AccelerationSettings`, so each is a flag
and a YAML key like the rest): what requests that choose no `cache` get with --cache
taylorseer (`engine.request.CacheChoice`)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from engine.request import TAYLOR_SEER_DEFAULTS, TAYLOR_SEER_LIMITS


class TaylorSeerSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    cache_interval: int = Field(
        TAYLOR_SEER_DEFAULTS["interval"],
        ge=1,
        le=TAYLOR_SEER_LIMITS["interval"],
        description="with --cache taylorseer: after the warm-up, the denoiser runs one step in "
        "this many and the steps between are predicted from its last outputs (1 = every step)",
    )
    cache_warmup: int = Field(
        TAYLOR_SEER_DEFAULTS["warmup"],
        ge=0,
        le=TAYLOR_SEER_LIMITS["warmup"],
        description="with --cache taylorseer: the first steps of each request that always run",
    )
    cache_order: int = Field(
        TAYLOR_SEER_DEFAULTS["order"],
        ge=0,
        le=TAYLOR_SEER_LIMITS["order"],
        description="with --cache taylorseer: the Taylor series' order (0 reuses the last output, "
        "1 extrapolates its trend)",
    )

    def taylor_seer(self) -> dict[str, int]:
        """The `CacheChoice` fields these settings give."""
        return {"interval": self.cache_interval, "warmup": self.cache_warmup, "order": self.cache_order}
