"""Serving defaults a request leaves unset: `--default-true-cfg-scale` and
`--default-negative-prompt` (switching on FLUX's true CFG by default, as the shipped
shapes-dit does), a request's own values winning, and a model that takes no negative
prompt refusing the default at start."""

from __future__ import annotations

import pytest

from engine.request import GenerationRequest, SamplingParams
from pipelines.base import PipelineConfig
from pipelines.registry import load_pipeline

pytestmark = pytest.mark.slow


def test_a_request_gets_the_configured_negative_prompt_and_true_cfg_unless_it_sends_its_own() -> None:
    config = PipelineConfig(model="tiny-flux", default_true_cfg_scale=3.0, default_negative_prompt="blurry")
    pipeline = load_pipeline(config)
    plain = pipeline.resolve(GenerationRequest.create("a cat", SamplingParams()))
    assert (plain.negative_prompt, plain.true_cfg_scale) == ("blurry", 3.0)
    own = pipeline.resolve(
        GenerationRequest.create("a cat", SamplingParams(negative_prompt="dark", true_cfg_scale=1.0))
    )
    assert (own.negative_prompt, own.true_cfg_scale) == ("dark", 1.0)
    unset = load_pipeline(PipelineConfig(model="tiny-flux")).resolve(
        GenerationRequest.create("a cat", SamplingParams())
    )
    assert (unset.negative_prompt, unset.true_cfg_scale) == (None, 1.0)  # FLUX's own: off


def test_a_model_that_takes_no_negative_prompt_refuses_a_default_one() -> None:
    with pytest.raises(
        ValueError, match="default_negative_prompt: Flux2KleinPipeline takes no negative prompt"
    ):
        load_pipeline(PipelineConfig(model="tiny-flux2-klein", default_negative_prompt=" "))
