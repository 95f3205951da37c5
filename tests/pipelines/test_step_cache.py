"""First-Block Cache per request in step mode (issue 27): threshold 0 changes nothing, and
under the cache each request's images are the ones it makes alone, whoever shared its steps
(joins at different steps, mixed thresholds, some rows skipping while others compute)."""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any
from unittest.mock import patch

import pytest
import torch

from engine.request import CacheChoice, GenerationRequest, InvalidRequestError, RequestBatch, SamplingParams
from pipelines.adapter import DiffusersAdapter
from pipelines.base import PipelineConfig
from pipelines.cache.first_block import CachedStep
from pipelines.registry import load_pipeline
from tests.media import picture
from tests.pipelines.engines import difference
from tests.pipelines.test_stepping import loaded, run_interleaved
from tests.threads import THREADS

pytestmark = pytest.mark.slow

# (model, thresholds): the families whose denoiser is cached, with thresholds that skip some
# of their steps and not others (their first blocks' changes from step to step differ).
CASES = [
    ("shapes-dit", (0.08, 0.15, 0.3)),
    ("tiny-flux", (0.3, 0.45, 0.7)),
    ("tiny-qwen-image", (0.4, 0.55, 0.8)),
    ("tiny-sd3", (0.4, 0.55, 0.8)),
    ("tiny-wan", (0.055, 0.08, 0.15)),
    ("tiny-chroma", (0.35, 0.5, 0.6)),
    ("tiny-ovis-image", (0.33, 0.4, 0.45)),
    ("tiny-flux2", (0.6, 0.7, 0.9)),
    ("tiny-flux2-klein", (0.7, 0.95, 1.0)),
    ("tiny-z-image", (0.6, 0.7, 0.75)),
    # One forward per text length (a request's negative rows apart from its positive ones).
    ("tiny-qwen-image-21", (0.4, 0.5, 0.6)),
    # Two experts: a request's residuals start again at its switch.
    ("tiny-wan22", (0.04, 0.05, 0.07)),
    ("tiny-hunyuan-video15", (0.12, 0.16, 0.2)),
    ("tiny-ltx", (0.08, 0.09, 0.1)),
    # Three forwards per step (every row; the positive rows perturbed; isolated), each its own.
    ("tiny-ltx2", (0.07, 0.09, 0.11)),
]


def requests_of(pipeline: DiffusersAdapter, choices: list[CacheChoice | None], steps: list[int]) -> list[Any]:
    requests = []
    for i, (choice, count) in enumerate(zip(choices, steps, strict=True)):
        negative = "blurry" if i % 2 else None  # guidance rows for some (FLUX: true CFG)
        true_cfg = pipeline.default_true_cfg_scale is not None and negative is not None
        params = SamplingParams(
            num_inference_steps=count,
            seed=100 + i,
            n=1 + i % 2,
            cache=choice,
            negative_prompt=negative,
            true_cfg_scale=2.0 if true_cfg else None,
            num_frames=9 if pipeline.modality == "video" else None,
        )
        request = GenerationRequest.create(f"a red circle number {i}", params)
        requests.append(request.with_params(pipeline.resolve(request)))
    return requests


def alone(pipeline: DiffusersAdapter, request: GenerationRequest) -> tuple[Any, Any]:
    (state,) = pipeline.prepare([request])
    while not state.is_done:
        pipeline.step([state])
    (output,) = pipeline.finish([state])
    return output, state.cache


@pytest.mark.parametrize(("model", "thresholds"), CASES, ids=[m for m, _ in CASES])
def test_a_threshold_of_zero_or_no_cache_gives_todays_images(
    model: str, thresholds: tuple[float, ...]
) -> None:
    pipeline = loaded(model)
    (plain,) = requests_of(pipeline, [None], [6])
    zero = plain.with_params(replace(plain.params, cache=CacheChoice("first-block", 0.0)))
    none = plain.with_params(replace(plain.params, cache=CacheChoice("none", 0.5)))
    before, _ = alone(pipeline, plain)
    # The hooks installed (a request that caches has stepped) stay out of the way of the rest.
    alone(pipeline, requests_of(pipeline, [CacheChoice("first-block", thresholds[1])], [6])[0])
    assert pipeline.row_cache is not None
    for request in (plain, zero, none):
        output, cache = alone(pipeline, request)
        assert cache is None
        for image, reference in zip(output.images, before.images, strict=True):
            assert (image == reference).all()


@pytest.mark.parametrize(("model", "thresholds"), CASES, ids=[m for m, _ in CASES])
def test_each_request_under_the_cache_makes_its_own_images_in_any_group(
    model: str, thresholds: tuple[float, ...]
) -> None:
    """Mixed thresholds (and a request without the cache), step counts and joins: each image
    within 1/255 of the request alone, the same steps skipped, and steps where some rows
    skipped while others computed."""
    pipeline = loaded(model)
    low, mid, high = thresholds
    choices = [
        CacheChoice("first-block", high),
        None,
        CacheChoice("first-block", low),
        CacheChoice("first-block", mid),
        CacheChoice("first-block", high),
    ]
    requests = requests_of(pipeline, choices, [12, 8, 10, 12, 9])
    rng = random.Random(model)
    joins = sorted(rng.randrange(5) for _ in requests)
    mixed_steps = []
    commit = CachedStep.commit

    def counting(step: CachedStep) -> int:
        flags = {segment.compute for segment in step.segments}
        mixed_steps.append(flags == {True, False})
        return commit(step)

    caches: dict[str, Any] = {}
    finish = pipeline.finish

    def keep_caches(states: list[Any]) -> Any:
        caches.update({state.request.request_id: state.cache for state in states})
        return finish(states)

    with patch.object(CachedStep, "commit", counting), patch.object(pipeline, "finish", keep_caches):
        stepped = run_interleaved(pipeline, requests, joins)
    assert any(mixed_steps), "no step had rows skipping beside rows computing"
    assert pipeline.row_cache is not None
    rest_blocks = pipeline.row_cache.rest_blocks
    skipped_any = False
    for request in requests:
        output, cache = alone(pipeline, request)
        grouped = caches[request.request_id]
        if cache is None:
            assert grouped is None
        else:
            assert grouped.steps_skipped == cache.steps_skipped
            assert grouped.blocks_skipped == cache.blocks_skipped == cache.steps_skipped * rest_blocks
            skipped_any = skipped_any or cache.steps_skipped > 0
        for image, reference in zip(stepped[request.request_id].images, output.images, strict=True):
            assert difference(image, reference) <= 1, request.params
    assert skipped_any


def test_requests_with_prompts_of_other_lengths_join_a_cached_request() -> None:
    """Qwen-Image pads a group's prompts to its longest: a cached request whose group gains a
    longer prompt (and loses it again) keeps its images, as alone."""
    pipeline = loaded("tiny-qwen-image")
    short, long = requests_of(pipeline, [CacheChoice("first-block", 0.55)] * 2, [12, 4])
    long = replace(long, prompt=" ".join(["a long prompt about a red circle"] * 6))
    stepped = run_interleaved(pipeline, [short, long], [0, 3])
    for request in (short, long):
        output, _ = alone(pipeline, request)
        for image, reference in zip(stepped[request.request_id].images, output.images, strict=True):
            assert difference(image, reference) <= 1


def test_flux2_edits_with_references_cache_each_as_alone() -> None:
    """FLUX.2's reference tokens ride in the image stream after the noise's: edits with
    references, mixed thresholds, CFG on and off, joining at different steps."""
    pipeline = loaded("tiny-flux2-klein")
    requests = []
    for i, threshold in enumerate((0.7, 0.95, 1.0)):
        params = SamplingParams(
            num_inference_steps=8 + i,
            seed=i,
            guidance_scale=1.0 if i == 1 else 4.0,
            cache=CacheChoice("first-block", threshold),
        )
        images = (picture(64, 64, seed=10 * i), picture(64, 80, seed=10 * i + 1))
        request = GenerationRequest.create(f"a red cat {i}", params, input_images=images)
        requests.append(request.with_params(pipeline.resolve(request)))
    stepped = run_interleaved(pipeline, requests, [0, 1, 3])
    skipped = 0
    for request in requests:
        output, cache = alone(pipeline, request)
        skipped += cache.steps_skipped
        for image, reference in zip(stepped[request.request_id].images, output.images, strict=True):
            assert difference(image, reference) <= 1
    assert skipped > 0


# (model, thresholds at 32, 48 and 64 px): the families that tell First-Block Cache each row's
# own places on a grid of several sizes (`Family.caches_mixed_sizes`).
MIXED_SIZES = [("tiny-flux", (0.3, 0.45, 0.7)), ("tiny-flux2", (0.6, 0.7, 0.9))]


@pytest.mark.parametrize(("model", "thresholds"), MIXED_SIZES, ids=[m for m, _ in MIXED_SIZES])
def test_rows_of_three_sizes_under_the_caches_share_forwards_and_each_skips_as_alone(
    model: str, thresholds: tuple[float, ...]
) -> None:
    """32, 48 and 64 px under First-Block Cache (their own thresholds, steps, n, a negative
    prompt where the family takes one; the last joining at step 2) and a 32 px one under
    TaylorSeer share one step key and their forwards, laid on one padded grid: each request
    decides by its own tokens, so it skips the steps it skips alone and its images are its
    images alone."""
    pipeline = loaded(model)
    true_cfg = pipeline.family.guidance.true_cfg
    shapes = [(32, 8, None, 1), (48, 6, "blurry" if true_cfg else None, 2), (64, 8, None, 1)]
    requests = []
    for i, ((side, steps, negative, n), threshold) in enumerate(zip(shapes, thresholds, strict=True)):
        params = SamplingParams(
            width=side,
            height=side,
            num_inference_steps=steps,
            negative_prompt=negative,
            true_cfg_scale=2.5 if negative else None,
            n=n,
            seed=11 + i,
            cache=CacheChoice("first-block", threshold),
        )
        requests.append(GenerationRequest.create(f"a large red circle on a blue background {i}", params))
    taylor = SamplingParams(
        width=32, height=32, num_inference_steps=8, seed=20, cache=CacheChoice("taylorseer")
    )
    requests.append(GenerationRequest.create("a green square", taylor))
    requests = [request.with_params(pipeline.resolve(request)) for request in requests]
    assert len({pipeline.step_key(r) for r in requests}) == 1
    forwards: list[int] = []
    mixed_steps = []
    commit = CachedStep.commit

    def counting(step: CachedStep) -> int:
        mixed_steps.append({segment.compute for segment in step.segments} == {True, False})
        return commit(step)

    skips: dict[str, Any] = {}
    finish = pipeline.finish

    def keep_skips(states: list[Any]) -> Any:
        skips.update({state.request.request_id: (state.cache, state.taylor_seer) for state in states})
        return finish(states)

    hook = pipeline.pipe.transformer.register_forward_pre_hook(lambda *_: forwards.append(1))
    try:
        with patch.object(CachedStep, "commit", counting), patch.object(pipeline, "finish", keep_skips):
            stepped = run_interleaved(pipeline, requests, [0, 0, 2, 1])
    finally:
        hook.remove()
    assert len(forwards) == 10  # 30 steps alone; together every one of the 10 iterations
    assert any(mixed_steps), "no step had rows skipping beside rows computing"
    for request in requests:
        (state,) = pipeline.prepare([request])
        while not state.is_done:
            pipeline.step([state])
        (output,) = pipeline.finish([state])
        cache, taylor = skips[request.request_id]
        if state.cache is not None:
            assert cache.steps_skipped == state.cache.steps_skipped, request.params
        else:
            assert taylor.steps_skipped == state.taylor_seer.steps_skipped > 0
        for image, reference in zip(stepped[request.request_id].images, output.images, strict=True):
            assert difference(image, reference) <= 1, request.params
    assert any(cache is not None and cache.steps_skipped > 0 for cache, _ in skips.values())


def test_a_step_that_fails_leaves_every_cache_as_it_was() -> None:
    pipeline = loaded("shapes-dit")
    # Two schedules (8 and 6 steps), so each takes its own scheduler step: the second one's
    # fails after the first one's ran (requests on one schedule step together, in one call).
    requests = requests_of(pipeline, [CacheChoice("first-block", 0.3)] * 2, [8, 6])
    states = pipeline.prepare(requests)
    for _ in range(3):
        pipeline.step(states)
    before = [state.cache for state in states]
    blocks = pipeline.cache_blocks_skipped()  # every method's, as a pipeline shared with other tests counts
    failing = patch.object(states[1].scheduler, "step", side_effect=RuntimeError("scheduler step failed"))
    with failing, pytest.raises(RuntimeError, match="scheduler step failed"):
        pipeline.step(states)
    assert [state.cache for state in states] == before
    assert pipeline.cache_blocks_skipped() == blocks


def test_request_mode_runs_diffusers_hooks_over_the_batch() -> None:
    """A request-level forward with the cache is diffusers' pipeline with its own First-Block
    Cache on, and the hooks are gone after the call."""
    pipeline = loaded("shapes-dit")
    (request,) = requests_of(pipeline, [CacheChoice("first-block", 0.3)], [10])
    (cached,) = pipeline.forward(RequestBatch(key=(), requests=(request,)))
    assert not pipeline.pipe.transformer.is_cache_enabled
    from diffusers.hooks import FirstBlockCacheConfig

    pipeline.pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=0.3))
    try:
        plain = request.with_params(replace(request.params, cache=None))
        (stock,) = pipeline.forward(RequestBatch(key=(), requests=(plain,)))
    finally:
        pipeline.pipe.transformer.disable_cache()
    (uncached,) = pipeline.forward(RequestBatch(key=(), requests=(plain,)))
    assert difference(cached.images[0], stock.images[0]) == 0
    assert difference(cached.images[0], uncached.images[0]) > 0
    assert pipeline.batch_key(request) != pipeline.batch_key(plain)


def test_a_family_without_the_cache_refuses_it_by_field() -> None:
    sd = loaded("tiny-sd")
    params = SamplingParams(cache=CacheChoice("first-block", 0.1))
    with pytest.raises(InvalidRequestError) as refused:
        sd.validate(sd.resolve(GenerationRequest.create("x", params)))
    assert refused.value.param == "cache.mode"
    sd.validate(sd.resolve(GenerationRequest.create("x", SamplingParams(cache=CacheChoice("none")))))


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"mode": "teacache"}, "cache.mode"),
        ({"threshold": 1.5}, "cache.threshold"),
        ({"threshold": -0.1}, "cache.threshold"),
    ],
)
def test_a_bad_choice_names_its_field(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequestError) as refused:
        CacheChoice(**{"mode": "first-block", **fields})
    assert refused.value.param == param


def test_the_cache_is_the_requests_own_state() -> None:
    """A request's cache holds only its own rows, and goes with its state."""
    pipeline = loaded("shapes-dit")
    requests = requests_of(pipeline, [CacheChoice("first-block", 0.3)] * 2, [4, 4])
    states = pipeline.prepare(requests)
    pipeline.step(states)
    for state in states:
        (residuals,) = state.cache.residuals.values()  # one forward per step: one kind
        assert residuals.head.shape[0] == state.rows
        assert residuals.tail[0].shape[0] == state.rows
        assert torch.is_tensor(residuals.head)


def test_a_family_without_the_cache_refuses_it_as_the_servers_default() -> None:
    with pytest.raises(ValueError, match="cache"):
        load_pipeline(
            PipelineConfig(model="tiny-sd", num_threads=THREADS, cache=CacheChoice("first-block", 0.1))
        )
