"""A LoRA adapter on Wan 2.2 A14B goes into both experts: a request stepped with it equals
diffusers' own pipeline with the adapter loaded into `transformer` and (with
`load_into_transformer_2=True`) into `transformer_2`, run alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import WanPipeline

from engine.request import GenerationRequest, LoraRef, SamplingParams
from pipelines.base import PipelineConfig
from pipelines.registry import load_pipeline
from pipelines.tiny.cache import tiny_model_dir
from pipelines.tiny.lora import tiny_lora_dir
from tests.pipelines.engines import difference
from tests.pipelines.test_stepping import run_interleaved
from tests.threads import THREADS

pytestmark = pytest.mark.slow

MODEL = "tiny-wan22"


def stock(steps: int, seed: int, *, both: bool) -> np.ndarray:
    """diffusers' own pipeline with tiny-lora-1, in the high-noise expert or in both."""
    pipe = WanPipeline.from_pretrained(str(tiny_model_dir(MODEL)))
    source = str(tiny_lora_dir("tiny-lora-1", MODEL))
    pipe.load_lora_weights(source, adapter_name="a")
    if both:
        pipe.load_lora_weights(source, adapter_name="a", load_into_transformer_2=True)
    video: np.ndarray = pipe(
        prompt="a boat",
        height=32,
        width=32,
        num_frames=9,
        num_inference_steps=steps,
        guidance_scale=4.0,
        guidance_scale_2=3.0,
        generator=torch.Generator("cpu").manual_seed(seed),
        output_type="np",
    ).frames[0]
    return (video * 255).round().astype(np.uint8)


def test_a_stepped_request_with_an_adapter_equals_diffusers_with_it_in_both_experts() -> None:
    pipeline = load_pipeline(
        PipelineConfig(model=MODEL, num_threads=THREADS, lora_modules=(("a", "tiny-lora-1"),))
    )
    params = [  # 4 steps: the low-noise expert from step 3; 6 steps join a step later
        SamplingParams(
            num_inference_steps=steps,
            guidance_scale=4.0,
            guidance_scale_2=3.0,
            seed=seed,
            lora=LoraRef("a"),
            num_frames=9,  # as the stock call below (without it: the model's default)
            width=32,
            height=32,
        )
        for steps, seed in ((4, 5), (6, 6))
    ]
    requests = []
    for p in params:
        request = GenerationRequest.create("a boat", p)
        requests.append(request.with_params(pipeline.resolve(request)))
    stepped = run_interleaved(pipeline, requests, [0, 1])  # type: ignore[arg-type]
    for request in requests:
        steps, seed = request.params.num_inference_steps or 0, request.params.seed or 0
        expected = stock(steps, seed, both=True)
        assert difference(stepped[request.request_id].images[0], expected) <= 1
    # The low-noise expert's adapter matters: without it the video is another.
    first = requests[0]
    assert difference(stepped[first.request_id].images[0], stock(4, 5, both=False)) > 1
