"""Qwen-Image 2.1 reference images on its tiny model (`--reference-resolution 64`): stepped
requests with references (mixed steps, negatives with true CFG, n, joins at different steps)
each equal the stock pipeline run alone; 1, 2 and 3 references in one engine; the transformer
sees the references as diffusers gives them; one too many, and references too narrow, are
refused naming the image; an edit's size defaults to its last reference's."""

from __future__ import annotations

import asyncio
import random
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch

from engine.core.config import EngineConfig
from engine.core.engine import AsyncEngine
from engine.executor.thread_executor import ThreadExecutor
from engine.request import GenerationRequest, InvalidRequestError, RequestBatch, SamplingParams
from pipelines.adapter import DiffusersAdapter
from pipelines.base import PipelineConfig
from pipelines.family_options import FamilyOptions
from pipelines.registry import load_pipeline
from tests.media import picture
from tests.pipelines.engines import difference
from tests.pipelines.test_stepping import run_interleaved, stepped_matches_alone
from tests.threads import THREADS

pytestmark = pytest.mark.slow

# References resized to about 64x64 pixels (4x4 latent tokens), not the call's 1024x1024.
RESOLUTION = 64


@pytest.fixture(scope="module")
def pipeline() -> DiffusersAdapter:
    options = FamilyOptions(reference_resolution=RESOLUTION)
    loaded = load_pipeline(PipelineConfig(model="tiny-qwen-image-21", num_threads=THREADS, options=options))
    assert isinstance(loaded, DiffusersAdapter) and loaded.supports_step_batch
    return loaded


def references(count: int, seed: int) -> tuple[np.ndarray, ...]:
    """`count` pictures of one layout per count (64x64, 64x128, 64x192: references of 64x64,
    32x96 and 32x96 pixels), their pixels by `seed`."""
    return tuple(picture(64, 64 + 64 * i, seed=100 * seed + i) for i in range(count))


def resolved(pipeline: DiffusersAdapter, request: GenerationRequest) -> GenerationRequest:
    request = request.with_params(pipeline.resolve(request))
    pipeline.validate(request.params)
    return request


def test_each_request_with_references_matches_the_stock_pipeline_alone(
    pipeline: DiffusersAdapter,
) -> None:
    def make(pipeline: DiffusersAdapter, rng: random.Random) -> list[GenerationRequest]:
        shapes = [(3, None, 1), (4, "blurry", 2), (2, None, 1)]
        requests = []
        for i, (steps, negative, n) in enumerate(shapes):
            prompt = " ".join(rng.choice(["a", "red", "cat", "on", "the", "moon"]) for _ in range(1 + 3 * i))
            params = SamplingParams(
                num_inference_steps=steps,
                negative_prompt=negative,
                true_cfg_scale=4.0 if negative else None,
                n=n,
                seed=rng.randrange(1000),
            )
            sent = GenerationRequest.create(prompt, params, input_images=references(2, i))
            requests.append(resolved(pipeline, sent))
        return requests

    stepped = stepped_matches_alone(pipeline, None, make)
    assert all(image.shape == (64, 64, 4) for output in stepped.values() for image in output.images)


async def test_one_two_and_three_references_in_one_engine_each_match_alone(
    pipeline: DiffusersAdapter,
) -> None:
    requests = [
        GenerationRequest.create(
            f"a cat with {count} friends",
            SamplingParams(num_inference_steps=2 + count, seed=count, width=64, height=32),
            input_images=references(count, count),
        )
        for count in (0, 1, 2, 3)
    ]
    resolved_requests = [r.with_params(pipeline.resolve(r)) for r in requests]
    assert len({pipeline.step_key(r) for r in resolved_requests}) == 4  # the layouts differ
    engine = AsyncEngine(ThreadExecutor(lambda: pipeline), EngineConfig(max_num_seqs=8, batching="step"))
    await engine.start()
    try:
        served = await asyncio.gather(*(engine.generate(r) for r in requests))
    finally:
        await engine.stop()
        # The executor's progress reports go to this test's event loop, closed after it.
        pipeline.progress_callback = None
    for request, output in zip(resolved_requests, served, strict=True):
        (alone,) = pipeline.forward(RequestBatch(key=(), requests=(request,)))  # seeds given: the same
        assert output.images[0].shape == (32, 64, 4)
        assert difference(output.images[0], alone.images[0]) <= 1


def test_the_transformer_sees_the_references_as_diffusers_gives_them(pipeline: DiffusersAdapter) -> None:
    """The tiny model's image moves by under 1/255 for another reference (its builder's note),
    so the check is on the transformer's first forward: the stock call's inputs and the
    stepped one's are the same (references' latents before the noise, the text read with the
    pictures, the picture slots, the layout)."""
    transformer = pipeline.pipe.transformer
    original = transformer.forward
    seen: list[dict[str, Any]] = []

    def recording(*args: Any, **kwargs: Any) -> Any:
        seen.append(kwargs)
        return original(*args, **kwargs)

    sent = GenerationRequest.create(
        "the cat wears the hat", SamplingParams(num_inference_steps=1, seed=5), input_images=references(2, 7)
    )
    request = resolved(pipeline, sent)
    transformer.forward = recording
    try:
        pipeline.forward(RequestBatch(key=(), requests=(request,)))
        run_interleaved(pipeline, [request], [0])
    finally:
        transformer.forward = original
    stock, stepped = seen
    assert stock["img_shapes"] == stepped["img_shapes"] == [[(1, 4, 4), (1, 6, 2), (1, 4, 4)]]
    assert torch.equal(stock["img_mask"], stepped["img_mask"])
    assert int(stock["img_mask"].sum()) == (16 + 12 + 16) // 4  # every latent token has its slot
    for name in ("hidden_states", "encoder_hidden_states", "timestep"):
        assert torch.allclose(stock[name], stepped[name], atol=1e-5), name
    other = resolved(pipeline, replace(sent, input_images=references(2, 8)))
    seen.clear()
    transformer.forward = recording
    try:
        run_interleaved(pipeline, [other], [0])
    finally:
        transformer.forward = original
    assert not torch.allclose(seen[0]["hidden_states"][:, :28], stepped["hidden_states"][:, :28], atol=1e-3)


def test_references_are_counted_sized_and_checked(pipeline: DiffusersAdapter) -> None:
    assert pipeline.input_image_count == (0, 3) and pipeline.modality == "image+edit"
    pipeline.validate_inputs(3, has_mask=False)
    with pytest.raises(InvalidRequestError, match="0 to 3") as too_many:
        pipeline.validate_inputs(4, has_mask=False)
    assert too_many.value.param == "input_images"  # "image" on the wire
    # The call's default size: the LAST reference's aspect ratio at the resolution's area
    # (where the config sets none; the tiny model's sets 64x64).
    images = (picture(64, 64, 1), picture(128, 64, 2))
    wide = GenerationRequest.create("x", SamplingParams(), input_images=images)
    assert (pipeline.resolve(wide).width, pipeline.resolve(wide).height) == (64, 64)
    config = pipeline.family.config
    pipeline.family.config = replace(config, default_size=None)
    try:
        params = pipeline.resolve(wide)
    finally:
        pipeline.family.config = config
    assert (params.width, params.height) == (96, 32)
    narrow = GenerationRequest.create("x", SamplingParams(), input_images=(picture(1280, 64, 1),))
    with pytest.raises(InvalidRequestError, match="at least 32") as refused:
        pipeline.resolve(narrow)
    assert refused.value.param == "image"
