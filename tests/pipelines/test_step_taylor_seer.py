"""TaylorSeer per request in step mode (issue 27): an interval of 1 changes nothing, the
schedule is diffusers' own, and under TaylorSeer each request's images are the ones it makes
alone, whoever shared its steps (joins at different steps, mixed settings and modes, some
requests predicted while others compute)."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import replace
from typing import Any
from unittest.mock import patch

import numpy as np
import pytest
import torch
from diffusers.hooks import HookRegistry
from diffusers.hooks.hooks import CacheContext, StateManager
from diffusers.hooks.taylorseer_cache import TaylorSeerCacheHook, TaylorSeerState

from engine.request import CacheChoice, GenerationRequest
from pipelines.adapter import DiffusersAdapter
from pipelines.cache.records import computes
from pipelines.cache.taylor_seer import TaylorSeerStep
from tests.pipelines import test_edit_stepping as edit_stepping
from tests.pipelines import test_flux_kontext_fill as kontext_fill
from tests.pipelines import test_wan_vace as wan_vace
from tests.pipelines.engines import difference
from tests.pipelines.test_step_cache import requests_of
from tests.pipelines.test_stepping import loaded, run_interleaved

# The families First-Block Cache also runs in (it goes beside TaylorSeer in their groups).
MODELS = ["shapes-dit", "tiny-flux", "tiny-qwen-image", "tiny-sd3", "tiny-wan"]
# The other text-to-image families that step: UNets and the DiTs whose output only is cached.
IMAGE_MODELS = [
    "tiny-sd",
    "tiny-sdxl",
    "tiny-chroma",
    "tiny-ovis-image",
    "tiny-flux2",
    "tiny-flux2-klein",
    "tiny-z-image",
    "tiny-qwen-image-21",
]
# The video families that step besides Wan 2.1: two experts (Wan 2.2), three passes and two
# outputs per row (LTX-2).
VIDEO_MODELS = ["tiny-ltx", "tiny-ltx2", "tiny-hunyuan-video15", "tiny-wan22"]


def seer(interval: int, warmup: int, order: int) -> CacheChoice:
    return CacheChoice("taylorseer", interval=interval, warmup=warmup, order=order)


def alone(pipeline: DiffusersAdapter, request: GenerationRequest) -> tuple[Any, Any]:
    (state,) = pipeline.prepare([request])
    while not state.is_done:
        pipeline.step([state])
    (output,) = pipeline.finish([state])
    return output, state.taylor_seer


# A warm-up of 0 is left out: diffusers' hook would predict at step 0 with nothing computed
# (it raises); a request's series computes its first step whatever its schedule says.
@pytest.mark.parametrize(("interval", "warmup"), [(2, 1), (3, 1), (5, 3), (4, 6)])
def test_the_schedule_is_diffusers_own(interval: int, warmup: int) -> None:
    """Which calls diffusers' hook computes, step by step, against `computes`."""
    module = torch.nn.Identity()
    hook = TaylorSeerCacheHook(
        cache_interval=interval,
        disable_cache_before_step=warmup,
        taylor_factors_dtype=torch.float32,
        state_manager=StateManager(TaylorSeerState, init_kwargs={"max_order": 1}),
    )
    HookRegistry.check_if_exists_or_initialize(module).register_hook(hook, "taylorseer")
    hook.state_manager.set_context(CacheContext("cond"))
    calls = []
    with patch.object(TaylorSeerState, "update", autospec=True, side_effect=TaylorSeerState.update) as update:
        for step in range(20):
            before = update.call_count
            module(torch.full((1,), float(step)))
            calls.append(update.call_count > before)
    assert calls == [computes(step, interval, warmup) for step in range(20)]


@pytest.mark.slow
# (The video families' interval 1 is the same code; their groups below are the costly part.)
@pytest.mark.parametrize("model", MODELS + IMAGE_MODELS)
def test_an_interval_of_one_or_no_cache_gives_todays_images(model: str) -> None:
    pipeline = loaded(model)
    (plain,) = requests_of(pipeline, [None], [6])
    every_step = plain.with_params(replace(plain.params, cache=seer(1, 0, 2)))
    before, _ = alone(pipeline, plain)
    for request in (plain, every_step):
        output, series = alone(pipeline, request)
        assert series is None
        for image, reference in zip(output.images, before.images, strict=True):
            assert (image == reference).all()


def group_choices(pipeline: DiffusersAdapter) -> list[CacheChoice | None]:
    """Mixed intervals, warm-ups and orders, a request without a cache, and one with First-Block
    Cache where the family runs it in step mode (another TaylorSeer where it does not)."""
    beside = CacheChoice("first-block", 0.05)
    if beside.mode not in pipeline.family.step_cache_modes():
        beside = seer(2, 2, 1)
    return [seer(2, 1, 1), None, seer(3, 2, 2), beside, seer(4, 0, 0)]


def check_groups_match_alone(
    pipeline: DiffusersAdapter, requests: list[GenerationRequest], seed: str
) -> None:
    """Each request's images in a group (joins at different steps) within 1/255 of the request
    alone, the same steps and blocks skipped, and some step where some requests were predicted
    while others computed."""
    rng = random.Random(seed)
    joins = sorted(rng.randrange(5) for _ in requests)
    mixed_steps = []
    learn = TaylorSeerStep.learn

    def counting(step: TaylorSeerStep, guided: Any, blocks: Any) -> None:
        mixed_steps.append(0 < len(step.computing) < len(step.states))
        learn(step, guided, blocks)

    series: dict[str, Any] = {}
    finish = pipeline.finish

    def keep_series(states: list[Any]) -> Any:
        series.update({state.request.request_id: state.taylor_seer for state in states})
        return finish(states)

    with patch.object(TaylorSeerStep, "learn", counting), patch.object(pipeline, "finish", keep_series):
        stepped = run_interleaved(pipeline, requests, joins)
    assert any(mixed_steps), "no step had requests predicted beside requests computing"
    predicted = False
    for request in requests:
        output, own = alone(pipeline, request)
        grouped = series[request.request_id]
        if own is None:
            assert grouped is None
        else:
            assert own.blocks_skipped >= own.steps_skipped  # a predicted step skips every block
            predicted = predicted or own.steps_skipped > 0
            assert (grouped.steps_skipped, grouped.blocks_skipped) == (own.steps_skipped, own.blocks_skipped)
        for image, reference in zip(stepped[request.request_id].images, output.images, strict=True):
            assert difference(image, reference) <= 1, request.params
        # LTX-2's audio track: the predicted row holds its latents beside the video's.
        for audio, expected in zip(
            stepped[request.request_id].extras.get("audio", []), output.extras.get("audio", []), strict=True
        ):
            np.testing.assert_allclose(audio, expected, rtol=0, atol=1e-3)
    assert predicted, "no request predicted a step alone"


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
def test_each_request_under_taylor_seer_makes_its_own_images_in_any_group(model: str) -> None:
    """Mixed settings and modes, different step counts and joins: each request's images are
    its own alone."""
    pipeline = loaded(model)
    check_groups_match_alone(
        pipeline, requests_of(pipeline, group_choices(pipeline), [12, 8, 10, 9, 11]), model
    )


@pytest.mark.slow
@pytest.mark.parametrize("model", IMAGE_MODELS)
def test_taylor_seer_needs_nothing_of_the_denoiser_in_any_stepping_family(model: str) -> None:
    """The same in the families whose denoiser First-Block Cache does not hook (UNets, blocks
    diffusers' registry does not know): TaylorSeer predicts only the guided output. Fewer
    steps than above, to keep the file's time modest."""
    pipeline = loaded(model)
    assert "taylorseer" in pipeline.family.step_cache_modes()
    check_groups_match_alone(pipeline, requests_of(pipeline, group_choices(pipeline), [8, 6, 7, 6, 8]), model)


@pytest.mark.slow
@pytest.mark.parametrize("model", VIDEO_MODELS)
def test_video_families_under_taylor_seer_make_their_own_videos_in_any_group(model: str) -> None:
    """The same for video: each request's frames (and LTX-2's audio) its own alone; on Wan 2.2
    the requests' experts switch at different steps of the group."""
    pipeline = loaded(model)
    check_groups_match_alone(pipeline, requests_of(pipeline, group_choices(pipeline), [6, 5, 6, 4, 6]), model)


def with_choices(pipeline: DiffusersAdapter, requests: list[GenerationRequest]) -> list[GenerationRequest]:
    choices = group_choices(pipeline)
    return [
        request.with_params(replace(request.params, cache=choices[i % len(choices)]))
        for i, request in enumerate(requests)
    ]


# Tasks with input images, through each family's own way of taking them: FLUX Kontext's
# reference tokens, FLUX Fill's mask channels, a 9-channel inpainting UNet, Z-Image's
# image-to-image (a schedule started part way), Wan VACE's control video and references.
EDIT_CASES: dict[str, Callable[[], tuple[DiffusersAdapter, list[GenerationRequest]]]] = {
    "flux-kontext": lambda: _edits(kontext_fill.loaded("tiny-flux-kontext"), kontext_fill.mixed_requests),
    "flux-fill": lambda: _edits(kontext_fill.loaded("tiny-flux-fill"), kontext_fill.mixed_requests),
    "sd-inpaint": lambda: _edits(edit_stepping.loaded("sd-inpaint"), edit_stepping.mixed_requests),
    "z-image-img2img": lambda: _edits(edit_stepping.loaded("z-image-img2img"), edit_stepping.mixed_requests),
    "wan-vace": lambda: _edits(loaded("tiny-wan-vace"), wan_vace.vace_requests(1, control=True)),
}


def _edits(
    pipeline: DiffusersAdapter,
    make: Callable[[DiffusersAdapter, random.Random], list[GenerationRequest]],
) -> tuple[DiffusersAdapter, list[GenerationRequest]]:
    return pipeline, with_choices(pipeline, make(pipeline, random.Random(7)))


@pytest.mark.slow
@pytest.mark.parametrize("case", list(EDIT_CASES))
def test_edits_under_taylor_seer_are_their_own_in_any_group(case: str) -> None:
    pipeline, requests = EDIT_CASES[case]()
    check_groups_match_alone(pipeline, requests, case)


@pytest.mark.slow
def test_ltx2_predicts_the_guided_video_and_audio_together() -> None:
    """LTX-2's step is up to three forwards (with and without the prompt, perturbed blocks,
    modalities isolated): a request's series is of its final guided row, video and audio
    latents joined, and a predicted step runs none of the passes."""
    pipeline = loaded("tiny-ltx2")
    (request,) = requests_of(pipeline, [seer(2, 1, 1)], [5])
    (state,) = pipeline.prepare([request])
    calls = []
    hook = pipeline.pipe.transformer.register_forward_pre_hook(
        lambda module, args: calls.append(state.steps_done)
    )
    try:
        while not state.is_done:
            pipeline.step([state])
    finally:
        hook.remove()
    assert state.taylor_seer.series.taylor_factors[0][0].shape == state.latents.shape
    assert sorted(set(calls)) == [step for step in range(5) if computes(step, 2, 1)]
    assert calls.count(0) == pipeline.family.passes(request) - 1  # its passes: CFG's rows in one


@pytest.mark.slow
def test_a_wan22_series_starts_again_at_the_expert_switch() -> None:
    """The low-noise expert is another function of the latents: a request's series restarts at
    its switch (that step computes, and the warm-up counts from it), and each step's series and
    skipped blocks are of its expert. (Groups switching at different steps: the video test.)"""
    pipeline = loaded("tiny-wan22")
    (request,) = requests_of(pipeline, [seer(2, 1, 1)], [7])
    (state,) = pipeline.prepare([request])
    switch = state.switch_step
    assert 0 < switch < 6 and not computes(switch, 2, 1)  # the whole schedule would predict it
    steps: list[tuple[bool, Any]] = []
    learn = TaylorSeerStep.learn

    def recording(step: TaylorSeerStep, guided: Any, blocks: Any) -> None:
        (cache,) = step.caches
        assert cache is not None
        steps.append((step.known[0] is None, cache.denoiser))
        learn(step, guided, blocks)

    with patch.object(TaylorSeerStep, "learn", recording):
        while not state.is_done:
            pipeline.step([state])
    expected = [computes(i, 2, 1) if i < switch else computes(i - switch, 2, 1) for i in range(7)]
    assert [computed for computed, _ in steps] == expected
    high, low = pipeline.pipe.transformer, pipeline.pipe.transformer_2
    assert [denoiser for _, denoiser in steps] == [high] * switch + [low] * (7 - switch)
    assert state.taylor_seer.start == switch and state.taylor_seer.denoiser is low


@pytest.mark.slow
def test_a_step_that_fails_leaves_every_series_as_it_was() -> None:
    pipeline = loaded("shapes-dit")
    # Two schedules, so the second's own scheduler step fails after the first one's ran.
    requests = requests_of(pipeline, [seer(2, 1, 1)] * 2, [8, 6])
    states = pipeline.prepare(requests)
    for _ in range(3):
        pipeline.step(states)
    before = [state.taylor_seer for state in states]
    factors = [dict(cache.series.taylor_factors[0]) for cache in before]
    skipped = pipeline.cache_blocks_skipped()
    failing = patch.object(states[1].scheduler, "step", side_effect=RuntimeError("scheduler step failed"))
    with failing, pytest.raises(RuntimeError, match="scheduler step failed"):
        pipeline.step(states)
    assert [state.taylor_seer for state in states] == before
    for cache, kept in zip(before, factors, strict=True):
        assert all(cache.series.taylor_factors[0][k] is v for k, v in kept.items())
    assert pipeline.cache_blocks_skipped() == skipped


def test_a_series_update_that_fails_leaves_the_step_undone() -> None:
    """The series are learnt before the states move: if that raises (a series update
    allocates, and may run out of memory), no request has stepped, so the engine's retry in
    halves steps each once, and the images are the ones made without the failure."""
    pipeline = loaded("shapes-dit")
    requests = requests_of(pipeline, [seer(2, 1, 1)] * 2, [6, 6])
    expected = [alone(pipeline, request)[0] for request in requests]
    states = pipeline.prepare(requests)
    done, latents = [s.steps_done for s in states], [s.latents.clone() for s in states]  # step 0 computes
    with (
        patch.object(TaylorSeerState, "update", side_effect=RuntimeError("out of memory")),
        pytest.raises(RuntimeError, match="out of memory"),
    ):
        pipeline.step(states)
    assert [s.steps_done for s in states] == done
    assert all(torch.equal(s.latents, kept) for s, kept in zip(states, latents, strict=True))
    for state in states:  # as the engine retries: in halves
        while not state.is_done:
            pipeline.step([state])
    for got, want in zip(pipeline.finish(states), expected, strict=True):
        assert difference(got.images[0], want.images[0]) <= 1


@pytest.mark.slow
def test_the_series_is_the_requests_own_state() -> None:
    """A request's series holds only its own images' rows (its guided output), up to its
    order, and goes with its state."""
    pipeline = loaded("shapes-dit")
    requests = requests_of(pipeline, [seer(2, 0, 2), seer(2, 0, 1)], [6, 6])
    states = pipeline.prepare(requests)
    for _ in range(4):
        pipeline.step(states)
    for state, order in zip(states, (2, 1), strict=True):
        factors = state.taylor_seer.series.taylor_factors[0]
        assert sorted(factors) == list(range(order + 1))
        assert factors[0].shape[0] == state.num_images
        assert state.taylor_seer.steps_skipped == 1  # step 2 predicted; 0, 1 and 3 computed
