"""FLUX.2 [dev] and [klein] on their tiny models: stepped requests (mixed steps, guidance —
klein's true CFG on and off —, n, joins at different steps, with and without references)
each equal the stock pipeline run alone; 1, 2 and 3 references in one engine; request-level
batching equals alone; what the pipelines refuse is refused at admission."""

from __future__ import annotations

import asyncio
import random
from dataclasses import replace

import numpy as np
import pytest

from engine.core.config import EngineConfig
from engine.core.engine import AsyncEngine
from engine.executor.thread_executor import ThreadExecutor
from engine.request import GenerationRequest, InvalidRequestError, RequestBatch, SamplingParams
from pipelines.adapter import DiffusersAdapter
from pipelines.base import PipelineConfig
from pipelines.registry import load_pipeline
from tests.media import picture
from tests.pipelines.engines import difference, start_batching_engine
from tests.pipelines.test_stepping import preview_decoder, run_alone, stepped_matches_alone
from tests.threads import THREADS

pytestmark = pytest.mark.slow

MODELS = ["tiny-flux2", "tiny-flux2-klein"]
_LOADED: dict[str, DiffusersAdapter] = {}


def loaded(model: str) -> DiffusersAdapter:
    if model not in _LOADED:
        pipeline = load_pipeline(PipelineConfig(model=model, num_threads=THREADS))
        assert isinstance(pipeline, DiffusersAdapter) and pipeline.supports_step_batch
        _LOADED[model] = pipeline
    return _LOADED[model]


def references(count: int, seed: int) -> tuple[np.ndarray, ...]:
    """`count` pictures of one layout per count (64x64, then 64x80, 64x96 ...), their
    pixels by `seed`: requests with as many references share a step key."""
    return tuple(picture(64, 64 + 16 * i, seed=100 * seed + i) for i in range(count))


def mixed_requests(pipeline: DiffusersAdapter, rng: random.Random, count: int = 0) -> list[GenerationRequest]:
    """Step counts that share no timesteps, guidance above and below 1 (klein: CFG on and
    off), n, prompts of different lengths, `count` references each (different pictures)."""
    shapes = [(8, 4.0, 1), (4, 1.0, 2), (9, 5.0, 1), (6, 2.5, 2), (5, 0.0, 1)]
    requests = []
    for i, (steps, guidance, n) in enumerate(shapes):
        prompt = " ".join(rng.choice(["a", "red", "cat", "on", "the", "moon"]) for _ in range(1 + 4 * i))
        seed = rng.randrange(1000)
        params = SamplingParams(num_inference_steps=steps, guidance_scale=guidance, n=n, seed=seed)
        request = GenerationRequest.create(prompt, params, input_images=references(count, i))
        request = request.with_params(pipeline.resolve(request))
        pipeline.validate(request.params)
        requests.append(request)
    return requests


@pytest.mark.parametrize("count", [0, 2])
@pytest.mark.parametrize("model", MODELS)
def test_each_request_matches_the_stock_pipeline_alone(model: str, count: int) -> None:
    pipeline = loaded(model)
    make = lambda p, rng: mixed_requests(p, rng, count)  # noqa: E731
    stepped = stepped_matches_alone(pipeline, None, make)
    assert all(image.shape == (64, 64, 3) for output in stepped.values() for image in output.images)


@pytest.mark.parametrize("model", MODELS)
async def test_one_two_and_three_references_in_one_engine_each_match_alone(model: str) -> None:
    pipeline = loaded(model)
    requests = [
        GenerationRequest.create(
            f"a cat with {count} friends",
            SamplingParams(num_inference_steps=3 + count, seed=count, width=64, height=48),
            input_images=references(count, count),
        )
        for count in (0, 1, 2, 3)
    ]
    resolved = [r.with_params(pipeline.resolve(r)) for r in requests]
    assert len({pipeline.step_key(r) for r in resolved}) == 4  # the layouts differ
    engine = AsyncEngine(ThreadExecutor(lambda: pipeline), EngineConfig(max_num_seqs=8, batching="step"))
    await engine.start()
    try:
        served = await asyncio.gather(*(engine.generate(r) for r in requests))
    finally:
        await engine.stop()
    for request, output in zip(resolved, served, strict=True):
        (alone,) = pipeline.forward(RequestBatch(key=(), requests=(request,)))  # seeds given: the same
        assert output.images[0].shape == (48, 64, 3)
        assert difference(output.images[0], alone.images[0]) <= 1
    # The references reach their requests: another picture, another image.
    other = replace(resolved[2], input_images=references(2, 9), input_digest=None)
    (moved,) = pipeline.forward(RequestBatch(key=(), requests=(other,)))
    assert difference(moved.images[0], served[2].images[0]) > 1


def test_the_output_size_defaults_to_the_first_references() -> None:
    """As diffusers sizes it, unless the config sets a default size (the tiny models do)."""
    pipeline = loaded("tiny-flux2")
    images = (picture(96, 64, 1), picture(64, 64, 2))
    request = GenerationRequest.create("x", SamplingParams(), input_images=images)
    assert (pipeline.resolve(request).width, pipeline.resolve(request).height) == (64, 64)
    config = pipeline.family.config
    pipeline.family.config = replace(config, default_size=None)
    try:
        params = pipeline.resolve(request)
    finally:
        pipeline.family.config = config
    assert (params.width, params.height) == (96, 64)


@pytest.mark.parametrize(("model", "most"), [("tiny-flux2", 6), ("tiny-flux2-klein", 4)])
def test_more_references_than_the_model_takes_and_negatives_are_refused(model: str, most: int) -> None:
    pipeline = loaded(model)
    assert pipeline.input_image_count == (0, most)
    pipeline.validate_inputs(most, has_mask=False)
    with pytest.raises(InvalidRequestError, match=f"0 to {most}") as raised:
        pipeline.validate_inputs(most + 1, has_mask=False)
    assert raised.value.param == "input_images"  # "image" on the wire
    request = GenerationRequest.create("x", SamplingParams(negative_prompt="blurry"))
    with pytest.raises(InvalidRequestError) as refused:
        pipeline.validate(pipeline.resolve(request))
    assert refused.value.param == "negative_prompt"
    small = GenerationRequest.create("x", SamplingParams(), input_images=(picture(48, 64, 1),))
    with pytest.raises(InvalidRequestError, match="at least 64") as too_small:
        pipeline.resolve(small)
    assert too_small.value.param == "image"


def test_a_step_distilled_klein_takes_no_negative_rows() -> None:
    """`is_distilled` turns klein's CFG off whatever the guidance scale, as diffusers does."""
    pipeline = load_pipeline(PipelineConfig(model="tiny-flux2-klein", num_threads=THREADS))
    assert isinstance(pipeline, DiffusersAdapter)
    params = SamplingParams(guidance_scale=4.0, num_inference_steps=3, seed=1)
    request = GenerationRequest.create("a cat", params)
    request = request.with_params(pipeline.resolve(request))
    assert pipeline.family.uses_cfg(request)
    pipeline.pipe.register_to_config(is_distilled=True)
    assert not pipeline.family.uses_cfg(request)
    make = lambda p, rng: [request]  # noqa: E731
    stepped_matches_alone(pipeline, None, make)


@pytest.mark.parametrize("model", MODELS)
async def test_a_request_level_batch_matches_each_request_alone(model: str) -> None:
    """Text-to-image requests batch; edits batch only with the very same references."""
    shared, other = references(1, 1), references(1, 2)

    def request(i: int, images: tuple[np.ndarray, ...] = (), **changes: object) -> GenerationRequest:
        params = replace(SamplingParams(num_inference_steps=3, seed=10 * i), **changes)  # type: ignore[arg-type]
        return GenerationRequest.create(f"a lighthouse, take {i} " * (1 + i), params, input_images=images)

    engine = await start_batching_engine(model)
    try:
        batched = await asyncio.gather(*(engine.generate(request(i, n=2 if i == 1 else 1)) for i in range(4)))
        assert engine.stats.forward_sizes == {4: 1}
        edits = await asyncio.gather(
            *(engine.generate(request(4 + i, images)) for i, images in enumerate([shared, shared, other]))
        )
        assert engine.stats.forward_sizes == {4: 1, 2: 1, 1: 1}
        alone = [await engine.generate(request(i)) for i in range(4)]
        edits_alone = [
            await engine.generate(request(4 + i, images)) for i, images in enumerate([shared, shared, other])
        ]
    finally:
        await engine.stop()
    for together, single in zip([*batched, *edits], [*alone, *edits_alone], strict=True):
        assert difference(together.images[0], single.images[0]) <= 1
    assert len(batched[1].images) == 2
    assert difference(batched[0].images[0], batched[3].images[0]) > 10


def test_previews_of_an_edit_converge_and_change_nothing() -> None:
    pipeline = loaded("tiny-flux2-klein")
    runs = []
    with preview_decoder(pipeline, "vae"):
        for partial_images in (0, 3):
            params = SamplingParams(num_inference_steps=8, seed=3, partial_images=partial_images)
            request = GenerationRequest.create("a red cat", params, input_images=references(2, 1))
            runs.append(run_alone(pipeline, request.with_params(pipeline.resolve(request))))
    (no_previews, plain), (previews, output) = runs
    assert no_previews == [] and [step for step, _ in previews] == [2, 4, 6]
    assert (plain.images[0] == output.images[0]).all()
    final = output.images[0].astype(float)
    errors = [np.abs(images[0].astype(float) - final).mean() for _, images in previews]
    assert errors[-1] < errors[0], errors
