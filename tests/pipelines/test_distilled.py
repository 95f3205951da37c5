"""Distilled models. DMD2-style SDXL: a few fixed timesteps with `LCMScheduler`, set by the
preset (`scheduler`, `timesteps`). Served step-level where the family's stages set the
timesteps on each request's scheduler (Stable Diffusion's, SDXL's), each request equal to its
stock run alone; request-level elsewhere; a scheduler that takes no timesteps is refused at
load. LCM-distilled UNets (a guidance embedding) step too, each row at its request's scale."""

from __future__ import annotations

import random

import pytest
import torch
from diffusers import UNet2DConditionModel

from engine.request import GenerationRequest, InvalidRequestError, SamplingParams
from pipelines.adapter import DiffusersAdapter
from pipelines.base import PipelineConfig
from pipelines.registry import load_pipeline
from tests.pipelines.test_stepping import stepped_matches_alone
from tests.threads import THREADS

pytestmark = pytest.mark.slow

DMD2 = (999, 749, 499, 249)  # DMD2's published four-step schedule


def distilled(model: str = "tiny-sdxl", **settings: object) -> DiffusersAdapter:
    config = PipelineConfig(
        model=model,
        num_threads=THREADS,
        scheduler="LCMScheduler",
        timesteps=DMD2,
        **settings,  # type: ignore[arg-type]
    )
    pipeline = load_pipeline(config)
    assert isinstance(pipeline, DiffusersAdapter)
    return pipeline


@pytest.fixture(scope="module")
def dmd2() -> DiffusersAdapter:
    return distilled()


def dmd2_requests(pipeline: DiffusersAdapter, rng: random.Random) -> list[GenerationRequest]:
    """Guidance 0 (DMD2's) and with classifier-free guidance, negatives, n, all at the fixed
    timesteps (LCMScheduler draws fresh noise from each request's generators between steps)."""
    shapes = [(0.0, None, 1), (0.0, "blurry", 2), (5.0, "ugly", 1), (3.0, None, 2)]
    requests = []
    for i, (guidance, negative, n) in enumerate(shapes):
        prompt = " ".join(rng.choice(["a", "red", "cat", "moon", "painting"]) for _ in range(1 + 3 * i))
        params = SamplingParams(
            guidance_scale=guidance, negative_prompt=negative, n=n, seed=rng.randrange(1000)
        )
        request = GenerationRequest.create(prompt, params)
        requests.append(request.with_params(pipeline.resolve(request)))
    return requests


def test_dmd2_steps_and_each_request_equals_its_stock_run_alone(dmd2: DiffusersAdapter) -> None:
    assert type(dmd2.pipe.scheduler).__name__ == "LCMScheduler"
    assert dmd2.supports_step_batch and dmd2.steps == len(DMD2)
    # Joins at different steps, each against diffusers' own call with the fixed timesteps.
    stepped_matches_alone(dmd2, None, dmd2_requests)


def test_every_request_takes_the_fixed_timesteps(dmd2: DiffusersAdapter) -> None:
    request = GenerationRequest.create("a cat", SamplingParams(quality="low"))
    assert dmd2.resolve(request).num_inference_steps == len(DMD2)
    with pytest.raises(InvalidRequestError, match="num_inference_steps must be 4"):
        dmd2.validate(dmd2.resolve(GenerationRequest.create("a cat", SamplingParams(num_inference_steps=2))))


def test_schedules_that_cannot_run_are_refused_at_load() -> None:
    with pytest.raises(ValueError, match="scheduler: diffusers has no scheduler class 'LCMSchedular'"):
        load_pipeline(PipelineConfig(model="tiny-sdxl", scheduler="LCMSchedular"))
    with pytest.raises(ValueError, match="timesteps: DDIMScheduler takes no fixed timesteps"):
        load_pipeline(PipelineConfig(model="tiny-sdxl", scheduler="DDIMScheduler", timesteps=DMD2))
    with pytest.raises(ValueError, match="timesteps: LCMScheduler refuses"):
        load_pipeline(PipelineConfig(model="tiny-sdxl", scheduler="LCMScheduler", timesteps=(1500, 10)))


def test_a_family_whose_stages_take_no_fixed_timesteps_serves_them_request_level() -> None:
    ltx = load_pipeline(PipelineConfig(model="tiny-ltx", num_threads=THREADS, timesteps=(999, 500)))
    assert ltx.supports_request_batch and not ltx.supports_step_batch
    with pytest.raises(ValueError, match="timesteps: FluxPipeline's call takes no fixed timesteps"):
        load_pipeline(PipelineConfig(model="tiny-flux", timesteps=(999, 500)))


def lcm_requests(pipeline: DiffusersAdapter, rng: random.Random) -> list[GenerationRequest]:
    """Each its own steps and guidance (the embedding's scale), a negative (unused: a
    distilled UNet has no negative rows), n."""
    shapes = [(4, 8.0, None, 1), (2, 1.0, "blurry", 2), (6, 4.0, None, 1), (3, 2.5, None, 2)]
    requests = []
    for i, (steps, guidance, negative, n) in enumerate(shapes):
        prompt = " ".join(rng.choice(["a", "red", "cat", "moon"]) for _ in range(1 + 3 * i))
        params = SamplingParams(
            num_inference_steps=steps,
            guidance_scale=guidance,
            negative_prompt=negative,
            n=n,
            seed=rng.randrange(99),
        )
        request = GenerationRequest.create(prompt, params)
        requests.append(request.with_params(pipeline.resolve(request)))
    return requests


def test_an_lcm_distilled_unet_steps_each_row_at_its_own_guidance() -> None:
    pipeline = load_pipeline(PipelineConfig(model="tiny-sd", num_threads=THREADS, scheduler="LCMScheduler"))
    assert isinstance(pipeline, DiffusersAdapter)
    torch.manual_seed(0)  # the tiny UNet with LCM's guidance embedding (random weights)
    config = {**pipeline.pipe.unet.config, "time_cond_proj_dim": 8}
    pipeline.pipe.unet = UNet2DConditionModel.from_config(config).eval()
    assert pipeline.supports_step_batch
    stepped_matches_alone(pipeline, None, lcm_requests)
