"""The cache settings of `ServeSettings` (a base it inherits, so each is a flag and a YAML key
like the rest): the prompt-embedding cache in each worker (`pipelines.prompt_cache`) and the
result cache of the HTTP server (`server.result_cache`)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class CacheSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    # 256 MiB: a FLUX or Wan prompt (T5/UMT5, 512 tokens x 4096, bfloat16, and its pooled
    # row) is about 4 MiB, so ~60 of the largest prompts, thousands of CLIP ones (118 KiB), at
    # well under 1% of an 80 GB device; it lives where the text encoder's outputs do.
    prompt_cache_mb: float = Field(
        256.0,
        ge=0,
        allow_inf_nan=False,
        description="identical prompts and negative prompts are encoded once while they stay in "
        "an LRU of this many MiB per model and worker, kept on the device (0 = off)",
    )
    result_cache_mb: float = Field(
        0.0,
        ge=0,
        allow_inf_nan=False,
        description="answer an exact repeat of an image request that sets a seed (same model, "
        "adapter, prompt, uploads and every parameter that changes its pixels; not timeout, "
        "priority, user or response_format) from an LRU of this many MiB of encoded images "
        "(0 = off); requests without a seed, and streamed ones, always run",
    )
    result_cache_scope: Literal["tenant", "global"] = Field(
        "tenant",
        description="whose answers the result cache shares: each API key its own (tenant; else "
        "a key could tell by the speed of its answer that another key already ran that exact "
        "prompt and seed), or every key (global: a server whose keys are one user's)",
    )
