"""Qwen-Image-Edit-Plus (2509) and -Edit-2511 served step-level, on their tiny models: with
one, two or three input images per request, every request's images match the stock
diffusers call (`QwenImageEditPlusPipeline.__call__`, which refuses batches) run alone with
the same seed and parameters, within 1/255, while requests with different steps, guidance,
negative prompts (true CFG), n and pictures share steps and join at different steps.

The stock call resizes every reference to about 1024x1024 pixels for the VAE, seconds per
reference even on the tiny model; here that area is 128x128 (diffusers' module constant,
which the stock call and ours both read), so the matrix runs in seconds. The end-to-end
test (`tests/e2e/test_edit_plus.py`) serves the real area.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import replace

import numpy as np
import pytest
from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as edit_plus

from engine.request import GenerationRequest, InvalidRequestError, LoraRef, RequestBatch, SamplingParams
from pipelines.adapter import DiffusersAdapter
from pipelines.base import PipelineConfig
from pipelines.registry import load_pipeline
from tests.media import picture
from tests.pipelines.engines import difference
from tests.pipelines.test_stepping import mixed_requests, run_interleaved, stepped_matches_alone
from tests.threads import THREADS

pytestmark = pytest.mark.slow

_LOADED: dict[str, DiffusersAdapter] = {}


@pytest.fixture(autouse=True)
def small_references(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(edit_plus, "VAE_IMAGE_SIZE", 128 * 128)
    yield


def loaded(model: str) -> DiffusersAdapter:
    if model not in _LOADED:
        pipeline = load_pipeline(PipelineConfig(model=model, num_threads=THREADS))
        assert isinstance(pipeline, DiffusersAdapter) and pipeline.supports_step_batch
        _LOADED[model] = pipeline
    return _LOADED[model]


def pictures(count: int, request: int) -> tuple[np.ndarray, ...]:
    """`count` pictures of the request's own, each of its own aspect ratio (3:2, 1:1, 2:3),
    so every request of one count shares the references' sizes."""
    sizes = [(48, 32), (40, 40), (32, 48)]
    return tuple(picture(*sizes[i], seed=10 * request + i) for i in range(count))


def with_references(count: int) -> object:
    def make(pipeline: DiffusersAdapter, rng: random.Random) -> list[GenerationRequest]:
        # The text-to-image matrix (steps, guidance, negatives with true CFG, n), each
        # request with `count` pictures of its own.
        requests = []
        for i, request in enumerate(mixed_requests(pipeline, rng)):
            edited = GenerationRequest.create(request.prompt, request.params, input_images=pictures(count, i))
            requests.append(edited.with_params(pipeline.resolve(edited)))
        return requests

    return make


CASES = [
    ("tiny-qwen-image-edit-2511", 1),
    ("tiny-qwen-image-edit-2511", 2),
    ("tiny-qwen-image-edit-2511", 3),
    ("tiny-qwen-image-edit-plus", 2),  # 2509: no zero_cond_t
]


@pytest.mark.parametrize(("model", "count"), CASES, ids=[f"{m}-{c}" for m, c in CASES])
def test_each_edit_matches_the_stock_pipeline_alone(model: str, count: int) -> None:
    pipeline = loaded(model)
    stepped = stepped_matches_alone(pipeline, None, with_references(count))  # type: ignore[arg-type]
    assert {image.shape for output in stepped.values() for image in output.images} == {(64, 64, 3)}


def test_the_step_key_holds_every_references_size_and_nothing_per_request() -> None:
    pipeline = loaded("tiny-qwen-image-edit-2511")

    def key(images: tuple[np.ndarray, ...], **fields: object) -> object:
        request = GenerationRequest.create("x", SamplingParams(**fields), input_images=images)  # type: ignore[arg-type]
        return pipeline.step_key(request.with_params(pipeline.resolve(request)))

    two = (picture(48, 32, 1), picture(32, 48, 2))
    assert key(two) == key(
        (picture(96, 64, 3), picture(64, 96, 4)), num_inference_steps=3, negative_prompt="x"
    )
    assert key(two) != key(two[::-1])  # same sizes, other order: another layout
    assert key(two) != key(two[:1]) != key((*two, two[0]))


def test_without_a_size_the_output_takes_the_last_images_aspect_ratio() -> None:
    """As diffusers: the last image's aspect ratio at the VAE's area (here 128x128), in
    multiples of 16 (the tiny model's --default-size would otherwise win)."""
    pipeline = loaded("tiny-qwen-image-edit-2511")
    images = (picture(32, 48, 1), picture(48, 32, 2))
    request = GenerationRequest.create("x", SamplingParams(), input_images=images)
    assert pipeline.family.reference_output_size(request) == (160, 96)
    assert pipeline.family.reference_sizes(request) == ((96, 160), (160, 96))


def test_more_images_than_the_model_takes_are_refused_naming_them() -> None:
    pipeline = loaded("tiny-qwen-image-edit-2511")
    pipeline.validate_inputs(3, has_mask=False)
    with pytest.raises(InvalidRequestError, match="1 to 3 input images, got 4") as raised:
        pipeline.validate_inputs(4, has_mask=False)
    assert raised.value.param == "input_images"  # the server names it `image`


def test_a_lora_changes_the_edit_step_level_as_in_the_request_level_call() -> None:
    pipeline = load_pipeline(
        PipelineConfig(
            model="tiny-qwen-image-edit-2511", num_threads=THREADS, lora_modules=(("a", "tiny-lora-1"),)
        )
    )
    params = SamplingParams(num_inference_steps=3, seed=5, lora=LoraRef("a"))
    sent = GenerationRequest.create("a boat", params, input_images=pictures(2, 0))
    sent = sent.with_params(pipeline.resolve(sent))
    assert isinstance(pipeline, DiffusersAdapter)
    (stepped,) = run_interleaved(pipeline, [sent], [0]).values()
    (alone,) = pipeline.forward(RequestBatch(key=(), requests=(sent,)))
    without = sent.with_params(replace(sent.params, lora=None))
    (base,) = pipeline.forward(RequestBatch(key=(), requests=(without,)))
    assert difference(stepped.images[0], alone.images[0]) <= 1
    assert difference(alone.images[0], base.images[0]) > 10
