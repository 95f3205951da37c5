"""Z-Image's own guidance on its tiny model: `cfg_truncation` (no guidance once a step's
normalised time passes it) and `cfg_normalization` (the guided norm capped per image), the
family's settings for every request, change images, and stepped requests still equal the
stock pipeline run alone with the same settings. (The common matrix, LoRA, edits and
batched = alone run in the shared family tests.)"""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.request import GenerationRequest, RequestBatch, SamplingParams
from pipelines.adapter import DiffusersAdapter
from pipelines.families.z_image import ZImage
from pipelines.registry import load_pipeline
from server.settings import ServeSettings
from tests.pipelines.engines import difference
from tests.pipelines.test_stepping import loaded, mixed_requests, run_alone, stepped_matches_alone
from tests.threads import THREADS


@pytest.mark.slow
def test_truncated_and_normalised_guidance_step_as_the_stock_pipeline() -> None:
    pipeline = loaded("tiny-z-image")
    family = pipeline.family
    assert isinstance(family, ZImage)
    sent = GenerationRequest.create(
        "a red cat", SamplingParams(num_inference_steps=6, seed=4, negative_prompt="x")
    )
    request = sent.with_params(pipeline.resolve(sent))

    def alone() -> np.ndarray:
        (output,) = pipeline.forward(RequestBatch(key=(), requests=(request,)))
        image: np.ndarray = output.images[0]
        return image

    plain = alone()
    defaults = family.cfg_truncation, family.cfg_normalization
    assert defaults == (1.0, 0.0)  # ZImagePipeline's own (`cfg_normalization=False`)
    try:
        family.cfg_truncation, family.cfg_normalization = 0.5, 0.0
        truncated = alone()
        family.cfg_truncation, family.cfg_normalization = 1.0, 1.0
        normalised = alone()
        family.cfg_truncation = 0.5
        stepped_matches_alone(pipeline, None, mixed_requests)
    finally:
        family.cfg_truncation, family.cfg_normalization = defaults
    assert difference(truncated, plain) > 1
    assert difference(normalised, plain) > 1


@pytest.mark.slow
def test_guidance_above_zero_adds_negative_rows() -> None:
    """ZImagePipeline guides at any scale above 0 (not above 1); Turbo's 0 runs one row."""
    pipeline = loaded("tiny-z-image")
    requests = mixed_requests(pipeline, random.Random(2))
    by_scale = {
        scale: replace(requests[0], params=replace(requests[0].params, guidance_scale=scale, n=1))
        for scale in (0.0, 0.5, 1.0)
    }
    rows = {scale: pipeline.prepare([r])[0].rows for scale, r in by_scale.items()}
    assert rows == {0.0: 1, 0.5: 2, 1.0: 2}


@pytest.mark.slow
def test_the_served_settings_reach_the_guide(tmp_path: Path) -> None:
    """`--cfg-truncation` and `--cfg-normalization` become the family's for every request:
    a stepped request equals the stock call given them, not the call at its defaults."""
    settings = ServeSettings.model_validate(
        {
            "model": "tiny-z-image",
            "output_dir": tmp_path,
            "num_threads": THREADS,
            "cfg_truncation": 0.5,
            "cfg_normalization": 1.0,
        }
    )
    pipeline = load_pipeline(settings.pipeline_config())
    assert isinstance(pipeline, DiffusersAdapter)
    family = pipeline.family
    assert isinstance(family, ZImage)
    assert (family.cfg_truncation, family.cfg_normalization) == (0.5, 1.0)
    params = SamplingParams(num_inference_steps=6, seed=4, negative_prompt="x", width=64, height=64)
    sent = GenerationRequest.create("a red cat", params)
    _, stepped = run_alone(pipeline, sent.with_params(pipeline.resolve(sent)))

    def stock(**guidance: float) -> np.ndarray:
        images = pipeline.pipe(
            prompt="a red cat",
            negative_prompt="x",
            num_inference_steps=6,
            height=64,
            width=64,
            generator=[torch.Generator("cpu").manual_seed(4)],
            output_type="np",
            **guidance,
        ).images
        return np.asarray((images[0] * 255).round(), dtype=np.uint8)

    assert difference(stepped.images[0], stock(cfg_truncation=0.5, cfg_normalization=1.0)) <= 1
    assert difference(stepped.images[0], stock()) > 1
