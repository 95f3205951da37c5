"""The batching settings of `ServeSettings` (a base it inherits, so each is a flag and a YAML
key like the rest): how many images share a forward or a step, how long an idle engine waits
for more, how much may wait, and how finished requests are decoded in step mode."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from server.switches import AutoSwitch


class BatchingSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    max_num_seqs: int = Field(8, ge=1, description="most images in one batched forward")
    request_batch_max_wait_ms: float = Field(
        0.0,
        ge=0,
        allow_inf_nan=False,
        description="how long an idle engine may wait for compatible requests (0 = never)",
    )
    max_queue_len: int = Field(1024, ge=1, description="most waiting requests; more get 429")
    max_queued_input_mb: float = Field(
        1024.0,
        gt=0,
        allow_inf_nan=False,
        description="most MiB of input images (edits, image-to-video) held by requests in progress; "
        "more get 429 (each image counts as stored: reduced to what the model uses)",
    )
    batching: Literal["request", "step"] = Field(
        "step",
        description="step: requests join and leave between denoising steps, each with its own "
        "steps, guidance and negative prompt (pipelines that cannot step fall back to request); "
        "request: same-key requests run as one batch to its end",
    )
    max_step_tokens: int | None = Field(
        None,
        ge=1,
        description="step mode: most rows x latent tokens stepping at once, so a large image or "
        "a video takes the share of several small images (default: max-num-seqs requests of the "
        "model's default size)",
    )
    decode_overlap: AutoSwitch = Field(
        "off",
        description="step mode: decode finished requests on a second thread while the others go "
        "on stepping: on, off, or auto (when a decode is measured to cost more than a step); "
        "it shares the host's cores, so measure it with diffbatch bench before turning it on; "
        "not with --offload model or sequential",
    )
    request_timeout_s: float | None = Field(
        600.0, gt=0, allow_inf_nan=False, description="per-request deadline in seconds; past it: 504"
    )
    video_timeout_s: float | None = Field(
        3600.0,
        gt=0,
        allow_inf_nan=False,
        description="deadline of a video job from its creation, in seconds; past it the job fails "
        "with code timeout and leaves the engine at the next step (step mode) or batch",
    )
