"""FLUX.1-Kontext (reference edits) and FLUX.1 Fill (inpainting with a transformer that reads
the mask) on their tiny models: stepped requests with mixed steps, guidance, negatives (Kontext's
true CFG), n, inputs, masks and joins at different steps each equal the stock pipeline run
alone, and a request-level batch equals each request alone."""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest

from engine.request import GenerationRequest, InvalidRequestError, RequestOutput, SamplingParams
from pipelines.adapter import DiffusersAdapter
from pipelines.base import PipelineConfig
from pipelines.registry import load_pipeline
from tests.media import picture
from tests.pipelines.engines import difference, start_batching_engine
from tests.pipelines.test_stepping import stepped_matches_alone
from tests.threads import THREADS

pytestmark = pytest.mark.slow

_LOADED: dict[str, DiffusersAdapter] = {}


def loaded(model: str) -> DiffusersAdapter:
    if model not in _LOADED:
        pipeline = load_pipeline(PipelineConfig(model=model, num_threads=THREADS))
        assert isinstance(pipeline, DiffusersAdapter) and pipeline.supports_step_batch
        _LOADED[model] = pipeline
    return _LOADED[model]


def box(i: int) -> np.ndarray:
    """A 48x64 mask (255 = repaint) with a box of its own."""
    mask = np.zeros((48, 64), np.uint8)
    mask[6 * i : 6 * i + 24, 4 * i : 4 * i + 32] = 255
    return mask


def mixed_requests(pipeline: DiffusersAdapter, rng: random.Random) -> list[GenerationRequest]:
    """Steps that share no timesteps, guidance, n, a negative prompt with a true CFG scale
    (Kontext; Fill takes none), each its own picture (one size: one reference layout) and,
    for Fill, its own mask."""
    fill = pipeline.accepts_mask
    shapes = [
        (8, 3.5, 1, None),
        (5, 1.0, 2, "blurry"),
        (9, 30.0, 1, None),
        (6, 2.5, 2, "dark"),
        (4, 0.0, 1, None),
    ]
    requests = []
    for i, (steps, guidance, n, negative) in enumerate(shapes):
        prompt = " ".join(rng.choice(["a", "red", "cat", "on", "the", "moon"]) for _ in range(1 + 3 * i))
        params = SamplingParams(
            width=64,
            height=48,
            num_inference_steps=steps,
            guidance_scale=guidance,
            negative_prompt=None if fill else negative,
            true_cfg_scale=2.0 if negative and not fill else None,
            n=n,
            seed=rng.randrange(1000),
        )
        request = GenerationRequest.create(
            prompt, params, input_images=(picture(64, 48, seed=i),), mask=box(i) if fill else None
        )
        request = request.with_params(pipeline.resolve(request))
        pipeline.validate(request.params)
        requests.append(request)
    return requests


@pytest.mark.parametrize("model", ["tiny-flux-kontext", "tiny-flux-fill"])
def test_each_request_matches_the_stock_pipeline_alone(model: str) -> None:
    stepped = stepped_matches_alone(loaded(model), None, mixed_requests)
    assert all(image.shape == (48, 64, 3) for output in stepped.values() for image in output.images)


def test_kontext_steps_together_only_with_its_reference_layout() -> None:
    pipeline = loaded("tiny-flux-kontext")

    def request(width: int, height: int) -> GenerationRequest:
        sent = GenerationRequest.create("x", SamplingParams(), input_images=(picture(width, height, 1),))
        return sent.with_params(pipeline.resolve(sent))

    # The reference keeps its own size (down to the size multiple, 4 here): the tiny VAE is 2x.
    assert pipeline.family.reference_sizes(request(66, 50)) == ((64, 48),)
    assert pipeline.step_key(request(66, 50)) == pipeline.step_key(request(64, 48))
    assert pipeline.step_key(request(64, 48)) != pipeline.step_key(request(48, 64))


def test_the_step_budget_measures_kontext_without_an_image() -> None:
    """The engine sizes its step budget on a request that sets nothing, image included (it
    raised IndexError at start): Kontext takes its reference at the output size."""
    pipeline = loaded("tiny-flux-kontext")
    default = GenerationRequest.create("", SamplingParams())
    params = pipeline.resolve(default)
    edit = GenerationRequest.create(
        "", params, input_images=(picture(params.width or 0, params.height or 0, 1),)
    )
    assert pipeline.step_cost(default.with_params(params)) == pipeline.step_cost(edit)


def test_fill_refuses_a_negative_prompt_and_a_true_cfg_scale() -> None:
    pipeline = loaded("tiny-flux-fill")
    for params, name in (
        (SamplingParams(negative_prompt="x"), "negative_prompt"),
        (SamplingParams(true_cfg_scale=2.0), "true_cfg_scale"),
    ):
        request = GenerationRequest.create("x", params, input_images=(picture(64, 48, 1),))
        with pytest.raises(InvalidRequestError) as raised:
            pipeline.validate(pipeline.resolve(request))
        assert raised.value.param == name


@pytest.mark.parametrize("model", ["tiny-flux-kontext", "tiny-flux-fill"])
async def test_a_request_level_batch_matches_each_request_alone(model: str) -> None:
    """Kontext batches requests with the very same reference; Fill any inputs and masks."""
    fill = model == "tiny-flux-fill"

    def request(i: int, n: int = 1) -> GenerationRequest:
        params = SamplingParams(num_inference_steps=3, seed=10 * i, n=n, width=64, height=48)
        image = picture(64, 48, seed=i if fill else 0)
        return GenerationRequest.create(
            f"a lighthouse, take {i} " * (1 + i), params, input_images=(image,), mask=box(i) if fill else None
        )

    engine = await start_batching_engine(model)
    try:
        batched = await asyncio.gather(*(engine.generate(request(i, n=2 if i == 1 else 1)) for i in range(3)))
        assert engine.stats.forward_sizes == {3: 1}
        alone: list[RequestOutput] = [await engine.generate(request(i)) for i in range(3)]
    finally:
        await engine.stop()
    for together, single in zip(batched, alone, strict=True):
        assert difference(together.images[0], single.images[0]) <= 1
    assert len(batched[1].images) == 2
    assert difference(batched[0].images[0], batched[2].images[0]) > 1
