"""The cache acceleration settings of `ServeSettings` (a base it inherits, so each is a flag
and a YAML key like the rest): what requests that choose no `cache` get."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field

from engine.request import CacheChoice
from server.taylor_seer_settings import TaylorSeerSettings


class AccelerationSettings(TaylorSeerSettings):
    model_config = ConfigDict(extra="forbid", frozen=True)

    cache: Literal["none", "first-block", "taylorseer"] = Field(
        "none",
        description="cache acceleration for requests that choose none (a request's own "
        '"cache": {"mode", "threshold"} replaces it): first-block skips the denoiser\'s later '
        "blocks at steps where its first block's output changed by less than --cache-threshold "
        "(DiT families; in step mode each request decides for itself); taylorseer predicts "
        "the denoiser's output between the steps it runs (--cache-interval, --cache-warmup, "
        "--cache-order; in step mode each request by its own steps); or none",
    )
    cache_threshold: float = Field(
        0.1,
        ge=0,
        le=1,
        allow_inf_nan=False,
        description="with --cache first-block: the relative change of the first block's residual "
        "below which a step reuses the rest of the blocks' last effect; higher skips more, "
        "0 skips nothing",
    )

    def cache_choice(self) -> CacheChoice:
        if self.cache == "taylorseer":
            return CacheChoice(self.cache, **self.taylor_seer())
        return CacheChoice(self.cache, self.cache_threshold)
