"""Qwen-Image 2.1 on its tiny model: why rows of different prompt lengths never share a
forward, that rows of one length do, and its RGBA images. (Stepped = stock alone with mixed
steps, guidance, negatives and n: `test_stepping.py`'s table.)"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import torch

from engine.request import GenerationRequest, RequestBatch, SamplingParams
from pipelines.adapter import DiffusersAdapter
from pipelines.base import PipelineConfig
from pipelines.registry import load_pipeline
from tests.pipelines.engines import difference
from tests.pipelines.test_stepping import run_interleaved
from tests.threads import THREADS

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pipeline() -> DiffusersAdapter:
    loaded = load_pipeline(PipelineConfig(model="tiny-qwen-image-21", num_threads=THREADS))
    assert isinstance(loaded, DiffusersAdapter)
    assert loaded.supports_step_batch and not loaded.supports_request_batch
    return loaded


def resolved(pipeline: DiffusersAdapter, prompt: str, **fields: Any) -> GenerationRequest:
    fields = {"num_inference_steps": 3, **fields}
    request = GenerationRequest.create(prompt, SamplingParams(**fields))
    return request.with_params(pipeline.resolve(request))


def test_diffusers_own_batch_pads_prompts_and_changes_the_image(pipeline: DiffusersAdapter) -> None:
    """Why diffusers' call serves one request at a time: a text token's rotary position is
    its place in the sequence, so padding a shorter prompt moves the image against it."""

    def call(prompts: list[str]) -> np.ndarray:
        generators = [torch.Generator("cpu").manual_seed(1) for _ in prompts]
        images = pipeline.pipe(
            prompt=prompts, width=64, height=64, num_inference_steps=3, generator=generators, output_type="np"
        ).images
        return np.asarray((images[0] * 255).round(), dtype=np.uint8)

    alone = call(["a cat"])
    assert difference(call(["a cat", "a red cat on the moon painting " * 3]), alone) > 1


def test_rows_of_one_text_length_share_a_forward(pipeline: DiffusersAdapter) -> None:
    calls: list[int] = []
    transformer = pipeline.pipe.transformer
    original = transformer.forward

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs["hidden_states"].shape[0])
        return original(*args, **kwargs)

    rng = random.Random(0)
    same = [resolved(pipeline, "a red cat", seed=rng.randrange(99)) for _ in range(2)]
    longer = resolved(pipeline, "a red cat on the moon", seed=3, n=2)
    transformer.forward = counting
    try:
        stepped = run_interleaved(pipeline, [*same, longer], [0, 0, 0])
    finally:
        transformer.forward = original
    assert calls == [2, 2] * 3  # each step: the two short rows, then the longer request's two
    for request in [*same, longer]:
        (alone,) = pipeline.forward(RequestBatch(key=(), requests=(request,)))
        for image, reference in zip(stepped[request.request_id].images, alone.images, strict=True):
            assert image.shape == (64, 64, 4)  # RGBA, as the pipeline's VAE decodes
            assert difference(image, reference) <= 1


def test_a_models_own_sigmas_serve_their_step_count_and_other_counts_still_work(
    pipeline: DiffusersAdapter,
) -> None:
    """`sample_sigmas` in the model index: diffusers takes them whatever the step count; a
    request with as many steps gets them, one with other steps the usual 1 → 1/steps (the
    request-level call is asked for those), stepped = stock alone either way."""
    three = resolved(pipeline, "a red cat", seed=1)
    four = resolved(pipeline, "a red cat", seed=1, num_inference_steps=4)
    usual = pipeline.prepare([three])[0].scheduler.sigmas
    pipeline.pipe.register_to_config(sample_sigmas=[1.0, 0.7, 0.3])
    try:
        states = pipeline.prepare([three, four])
        assert [len(state.timesteps) for state in states] == [3, 4]
        assert not torch.equal(states[0].scheduler.sigmas, usual)  # the model's own grid
        stepped = run_interleaved(pipeline, [three, four], [0, 0])
        for request in (three, four):
            (alone,) = pipeline.forward(RequestBatch(key=(), requests=(request,)))
            assert difference(stepped[request.request_id].images[0], alone.images[0]) <= 1
    finally:
        pipeline.pipe.register_to_config(sample_sigmas=None)
