"""The engine's limits at start: `max_num_seqs` and `max_step_tokens` lowered to what the
profile run fitted (`engine.worker.profile_run`), and the compute one step may take (step mode)."""

from __future__ import annotations

import logging
from dataclasses import replace

from engine.core.config import EngineConfig
from engine.request import GenerationRequest, SamplingParams
from engine.spec import PipelineSpec
from engine.worker.profile_run import ProfileResult

logger = logging.getLogger("engine.core.engine")


def fitted_to_profile(config: EngineConfig, profile: ProfileResult | None) -> EngineConfig:
    """`config` with `max_num_seqs` and `max_step_tokens` lowered to what the profile run
    fitted (each worker profiled its own device; `profile` is the tightest, which holds for
    all: one limit per engine)."""
    if profile is None or profile.state != "measured" or profile.max_num_seqs is None:
        return config
    tokens = profile.max_step_tokens
    lowered = replace(
        config,
        max_num_seqs=min(config.max_num_seqs, profile.max_num_seqs),
        max_step_tokens=tokens
        if config.max_step_tokens is None or tokens is None
        else min(tokens, config.max_step_tokens),
    )
    if lowered != config:
        logger.info(
            "the profile run lowered max_num_seqs %d -> %d, max_step_tokens %s -> %s",
            config.max_num_seqs,
            lowered.max_num_seqs,
            config.max_step_tokens,
            lowered.max_step_tokens,
        )
    return lowered


def step_budget(config: EngineConfig, spec: PipelineSpec) -> int:
    """Compute allowed in one step: as configured, or `max_num_seqs` requests of the
    model's default shape (so at that shape the image bound is the one that binds)."""
    if config.max_step_tokens is not None:
        return config.max_step_tokens
    default = GenerationRequest.create("", SamplingParams())
    default = default.with_params(replace(spec.resolve(default), seed=0))
    return config.max_num_seqs * spec.step_cost(default)
