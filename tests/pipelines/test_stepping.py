"""Step-level batching on the real tiny models: every request's images match the stock
diffusers pipeline run alone with the same seed and parameters (within 1/255), whatever
step it joined at and whoever shared its steps — for every family served step-level, and
on SD for each stateful scheduler kind."""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, Literal
from unittest.mock import patch

import numpy as np
import pytest
import torch
from diffusers import (
    DDIMScheduler,
    DPMSolverMultistepScheduler,
    EulerAncestralDiscreteScheduler,
    EulerDiscreteScheduler,
    PNDMScheduler,
    UniPCMultistepScheduler,
)

from engine.core.config import EngineConfig
from engine.core.engine import AsyncEngine
from engine.executor.thread_executor import ThreadExecutor
from engine.request import CacheChoice, GenerationRequest, RequestBatch, RequestOutput, SamplingParams
from pipelines.adapter import DiffusersAdapter
from pipelines.base import PipelineConfig
from pipelines.registry import load_pipeline
from pipelines.stepping.preview import LinearPreview
from tests.pipelines.engines import difference
from tests.pipelines.stock import stock_output
from tests.threads import THREADS

# Qwen-Image-Edit's input image at 128x128, not ~1024x1024, for the stock call and ours alike.
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("small_edit_references")]

SCHEDULERS = [
    DDIMScheduler,
    EulerDiscreteScheduler,
    EulerAncestralDiscreteScheduler,
    PNDMScheduler,
    DPMSolverMultistepScheduler,
    UniPCMultistepScheduler,
]


# (model, scheduler class or None for the model's own): every stepping family, and on SD
# every stateful scheduler kind.
CASES = [("tiny-sd", cls) for cls in SCHEDULERS] + [
    ("tiny-sdxl", None),
    ("tiny-sdxl", DPMSolverMultistepScheduler),
    ("tiny-qwen-image", None),  # true CFG (norm-rescaled) only for requests with a negative
    ("tiny-flux", None),  # distilled guidance per row; true CFG off (true_cfg_scale 1)
    ("tiny-sd3", None),
    ("tiny-wan", None),  # video: 9 frames each
    ("tiny-ltx", None),
    ("tiny-qwen-image-edit", None),  # the input image in the text encoder and the sequence
    ("tiny-wan-i2v", None),  # each request's own first frame, concatenated along channels
    ("tiny-qwen-image-21", None),  # one forward per text length; RGBA images
    # The shipped trained models (issue 26): the same classes with weights that draw.
    ("shapes", None),
    ("shapes-dit", None),  # T5 padded to the 32 tokens it learnt, not 512
    # Wan 2.2 (issue 24): two experts, each request switching at its own boundary step; TI2V's
    # per-token timesteps.
    ("tiny-wan22", None),
    ("tiny-wan22-i2v", None),
    ("tiny-wan22-ti2v", None),
    ("tiny-hunyuan-video15", None),  # two prompt streams with masks; CFG unless the scale is 1
    ("tiny-hunyuan-video15-i2v", None),  # SigLIP tokens and first-frame latents per request
    ("tiny-z-image", None),  # captions of their own lengths; CFG above 0, negated output
    ("tiny-chroma", None),  # T5 with a per-row mask; CFG as a second set of rows
    ("tiny-ovis-image", None),  # Qwen3 text of fixed length, no mask; CFG likewise
    ("tiny-ltx2", None),  # video and audio latents in one row; three passes; each audio track too
]
_LOADED: dict[str, DiffusersAdapter] = {}


def loaded(model: str) -> DiffusersAdapter:
    if model not in _LOADED:
        pipeline = load_pipeline(PipelineConfig(model=model, num_threads=THREADS))
        assert isinstance(pipeline, DiffusersAdapter) and pipeline.supports_step_batch
        _LOADED[model] = pipeline
    return _LOADED[model]


@pytest.fixture(scope="module")
def sd() -> DiffusersAdapter:
    return loaded("tiny-sd")


def mixed_requests(sd: DiffusersAdapter, rng: random.Random) -> list[GenerationRequest]:
    """Step counts that share no timesteps, guidance with and without CFG, negatives, n; for
    true-CFG families (FLUX, Qwen-Image) one negative request with a true CFG scale of its
    own. (At least 4 steps: PNDM's Runge-Kutta warm-up needs them, in the stock pipeline too.)"""
    shapes = [
        (8, 7.5, None, 1),
        (4, 1.0, None, 2),
        (13, 5.0, "ugly, blurry", 1),
        (6, 3.0, None, 2),
        (5, 0.0, "x", 1),
    ]
    requests = []
    # Edits: inputs of one aspect ratio (one condition size), different pictures.
    needs_image = sd.input_image_count[0] > 0
    for i, (steps, guidance, negative, n) in enumerate(shapes):
        prompt = " ".join(
            rng.choice(["a", "red", "cat", "on", "the", "moon", "painting"]) for _ in range(1 + 4 * i)
        )
        true_cfg = 2.5 if i == 2 and sd.default_true_cfg_scale is not None else None
        params = SamplingParams(
            num_inference_steps=steps,
            guidance_scale=guidance,
            true_cfg_scale=true_cfg,
            num_frames=9 if sd.modality == "video" else None,
            negative_prompt=negative,
            n=n,
            seed=rng.randrange(1000),
        )
        image = np.random.default_rng(i).integers(0, 256, (32, 48, 3), dtype=np.uint8)
        request = GenerationRequest.create(prompt, params, input_images=(image,) if needs_image else ())
        requests.append(request.with_params(sd.resolve(request)))
    return requests


def run_interleaved(
    sd: DiffusersAdapter, requests: list[GenerationRequest], joins: list[int]
) -> dict[str, RequestOutput]:
    """What the engine does: at each step boundary joiners are prepared, everyone running steps
    together in one forward, and those done are decoded together."""
    states: dict[str, Any] = {}
    outputs: dict[str, RequestOutput] = {}
    iteration = 0
    while len(outputs) < len(requests):
        joining = [r for r, j in zip(requests, joins, strict=True) if j == iteration]
        for request, state in zip(joining, sd.prepare(joining), strict=True):
            states[request.request_id] = state
        if states:
            sd.step(list(states.values()))
        done = [rid for rid, state in states.items() if state.is_done]
        if done:
            for output in sd.finish([states.pop(rid) for rid in done]):
                outputs[output.request_id] = output
        iteration += 1
    return outputs


@pytest.mark.parametrize(
    ("model", "scheduler_class"), CASES, ids=[f"{m}-{c.__name__ if c else 'own'}" for m, c in CASES]
)
def test_each_request_matches_the_stock_pipeline_alone(model: str, scheduler_class: Any) -> None:
    stepped_matches_alone(loaded(model), scheduler_class, mixed_requests)


def stepped_matches_alone(
    pipeline: DiffusersAdapter,
    scheduler_class: Any,
    make_requests: Callable[[DiffusersAdapter, random.Random], list[GenerationRequest]],
) -> dict[str, RequestOutput]:
    """Serve `make_requests`' requests step-level with `scheduler_class` (None: the model's
    own), joining at random steps, and check each request's images within 1/255 of
    diffusers' own `__call__` for it alone (`tests.pipelines.stock`, not our request-level
    path). The stepped outputs, by request id."""
    original = pipeline.pipe.scheduler
    if scheduler_class is not None:
        pipeline.pipe.scheduler = scheduler_class.from_config(original.config)
    try:
        rng = random.Random(f"{pipeline.config.model}/{type(pipeline.pipe.scheduler).__name__}")
        requests = make_requests(pipeline, rng)
        joins = sorted(rng.randrange(6) for _ in requests)
        stepped = run_interleaved(pipeline, requests, joins)
        for request in requests:
            alone = stock_output(pipeline, request)
            got = stepped[request.request_id]
            assert got.seeds == alone.seeds
            for image, reference in zip(got.images, alone.images, strict=True):
                assert difference(image, reference) <= 1, request.params
            # Other outputs (LTX-2's audio tracks and their rate) equal too.
            assert got.extras.keys() == alone.extras.keys()
            for name, values in alone.extras.items():
                for value, expected in zip(got.extras[name], values, strict=True):
                    np.testing.assert_allclose(value, expected, rtol=0, atol=1e-3, err_msg=name)
    finally:
        pipeline.pipe.scheduler = original
    return stepped


def test_a_step_changes_nothing_when_its_forward_fails(sd: DiffusersAdapter) -> None:
    (request,) = mixed_requests(sd, random.Random(0))[:1]
    (state,) = sd.prepare([request])
    before = state.latents.clone()
    # The UNet's forward raises (the module itself stays, as on an out-of-memory error).
    failing = patch.object(sd.pipe.unet, "forward", side_effect=RuntimeError("the forward fails"))
    with failing, pytest.raises(RuntimeError, match="the forward fails"):
        sd.step([state])
    assert state.steps_done == 0 and (state.latents == before).all()


@pytest.mark.parametrize("scheduler_class", [DPMSolverMultistepScheduler, EulerAncestralDiscreteScheduler])
def test_a_step_that_fails_at_one_request_moves_none_and_the_retry_matches_alone(
    sd: DiffusersAdapter, scheduler_class: Any
) -> None:
    """The third request's scheduler step raises: no request has moved (a multistep history,
    an ancestral scheduler's generator), so stepping each alone, as the runner retries, gives
    every request the image it makes alone."""
    original = sd.pipe.scheduler
    sd.pipe.scheduler = scheduler_class.from_config(original.config)
    try:
        requests = mixed_requests(sd, random.Random(7))[:3]
        states = sd.prepare(requests)
        sd.step(states)  # a history to keep
        before = [(state.steps_done, state.latents.clone()) for state in states]
        failing = states[2].scheduler

        def broken(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("scheduler step failed")

        failing.step = broken
        with pytest.raises(RuntimeError, match="scheduler step failed"):
            sd.step(states)
        del failing.step
        for state, (steps_done, latents) in zip(states, before, strict=True):
            assert state.steps_done == steps_done and (state.latents == latents).all()
        sd.step(states[:1])  # the runner's retry, in halves
        sd.step(states[1:])
        while not all(state.is_done for state in states):
            sd.step([state for state in states if not state.is_done])
        outputs = sd.finish(states)
        for request, got in zip(requests, outputs, strict=True):
            (alone,) = sd.forward(RequestBatch(key=(), requests=(request,)))
            for image, reference in zip(got.images, alone.images, strict=True):
                assert difference(image, reference) <= 1, request.params
    finally:
        sd.pipe.scheduler = original


def test_the_step_key_leaves_out_steps_guidance_and_negative_prompt(sd: DiffusersAdapter) -> None:
    requests = mixed_requests(sd, random.Random(1))
    assert len({sd.step_key(r) for r in requests}) == 1
    assert len({sd.batch_key(r) for r in requests}) == len(requests)


# Each family that mixes sizes, on its tiny model; and whether its call takes a negative
# prompt (FLUX.2's refuses one).
MIXING = [
    ("tiny-flux", True),
    ("shapes-dit", True),
    ("tiny-chroma", True),
    ("tiny-flux2", False),
    ("tiny-flux2-klein", False),
    ("tiny-ovis-image", True),
    ("tiny-z-image", True),
    ("tiny-sd3", True),
]


# The families that pack sizes end to end (the rest pad them to one grid).
PACKING = {"tiny-flux", "shapes-dit", "tiny-sd3", "tiny-flux2", "tiny-flux2-klein"}


@pytest.mark.parametrize(("model", "negatives"), MIXING)
def test_rows_of_three_sizes_share_forwards_and_each_matches_the_stock_pipeline_alone(
    model: str, negatives: bool
) -> None:
    """A family that mixes sizes in one forward (FLUX.1: `PackedRows`; Chroma, FLUX.2, Ovis:
    `PaddedGrid`; Z-Image: its transformer's own lists): 32, 48 and 64 px with their own steps, guidance, n
    and (where the call takes one) a negative prompt, the last joining at step 2, share one
    step key and their forwards, and each image equals diffusers' own call for it alone."""
    pipeline = loaded(model)
    true_cfg = pipeline.family.guidance.true_cfg
    shapes = [(32, 4, 3.5, None, 1), (48, 6, 5.0, "blurry" if negatives else None, 2), (64, 4, 1.0, None, 1)]
    requests = []
    for i, (side, steps, guidance, negative, n) in enumerate(shapes):
        params = SamplingParams(
            width=side,
            height=side,
            num_inference_steps=steps,
            guidance_scale=guidance,
            negative_prompt=negative,
            true_cfg_scale=2.5 if negative and true_cfg else None,
            n=n,
            seed=11 + i,
        )
        request = GenerationRequest.create(f"a large red circle on a blue background {i}", params)
        requests.append(request.with_params(pipeline.resolve(request)))
    assert len({pipeline.step_key(r) for r in requests}) == 1
    forwards: list[int] = []
    whole: list[int] = []  # the transformer's own forward: not run where the family packs
    family = pipeline.family
    denoise = family.denoise

    def counted(*args: Any) -> Any:
        forwards.append(1)
        return denoise(*args)

    hook = pipeline.pipe.transformer.register_forward_pre_hook(lambda *_: whole.append(1))
    family.denoise = counted  # type: ignore[method-assign,assignment]
    try:
        stepped = run_interleaved(pipeline, requests, [0, 0, 2])
    finally:
        hook.remove()
        del family.denoise
    # 14 steps alone, and as many forwards in groups of one size; together 6, each over rows
    # of two or three sizes (48 and 64 px finish together: one finish, a decode per size).
    assert len(forwards) == 6
    packs = family.packs_sizes_for(pipeline.task, requests[0])
    assert (model in PACKING) == packs
    assert len(whole) == (0 if packs else 6)
    for request in requests:
        alone = stock_output(pipeline, request)
        got = stepped[request.request_id]
        assert got.seeds == alone.seeds
        for image, reference in zip(got.images, alone.images, strict=True):
            assert image.shape == reference.shape
            assert difference(image, reference) <= 1, request.params


def test_with_mix_sizes_off_flux_keeps_one_step_group_per_size() -> None:
    flux = load_pipeline(PipelineConfig(model="tiny-flux", num_threads=THREADS, mix_sizes=False))
    assert isinstance(flux, DiffusersAdapter)
    requests = [
        GenerationRequest.create("a cat", SamplingParams(width=side, height=side)) for side in (32, 64)
    ]
    keys = {flux.step_key(r.with_params(flux.resolve(r))) for r in requests}
    assert len(keys) == 2
    assert flux.step_grid(requests[0]) == ()


def test_flux_packs_plain_requests_and_pads_them_beside_a_cached_one() -> None:
    """Plain and cached requests of any size share FLUX's step key; the plain ones pack
    (`step_packs`), a cached one does not (First-Block Cache decides per batch row), so a
    forward with it pads every row, and the step budget counts the grid (`step_grid`) unless
    every request of a group packs. `--mix-sizes pad` packs none."""
    flux = loaded("tiny-flux")

    def resolved(side: int, cache: CacheChoice | None = None) -> GenerationRequest:
        request = GenerationRequest.create("a cat", SamplingParams(width=side, height=side, cache=cache))
        return request.with_params(flux.resolve(request))

    plain = [resolved(side) for side in (32, 64)]
    cached = [resolved(side, CacheChoice("first-block", 0.2)) for side in (32, 64)]
    assert len({flux.step_key(r) for r in [*plain, *cached]}) == 1
    assert [flux.step_grid(r) for r in [*plain, *cached]] == [(8, 8), (16, 16)] * 2
    assert [flux.step_packs(r) for r in [*plain, *cached]] == [True, True, False, False]
    padding = replace(flux.config, pack_sizes=False)
    with patch.object(flux.family, "config", padding):
        assert not any(flux.step_packs(r) for r in plain)


def packing_pair(pipeline: DiffusersAdapter) -> list[GenerationRequest]:
    """Two plain requests, 32 and 48 px, 3 steps, resolved; both pack beside each other."""
    requests = []
    for i, side in enumerate((32, 48)):
        request = GenerationRequest.create(
            f"a cat {i}", SamplingParams(width=side, height=side, num_inference_steps=3, seed=i)
        )
        requests.append(request.with_params(pipeline.resolve(request)))
    assert all(pipeline.step_packs(r) for r in requests)
    return requests


def test_plain_flux_requests_pack_on_a_server_holding_an_ip_adapter() -> None:
    """The adapter's row attention replaces the double-stream blocks' processors; requests
    without a reference still pack (the attention backend is read where no adapter wraps
    it) and each equals its image alone from the same weights without the adapter."""
    config = PipelineConfig(
        model="tiny-flux", num_threads=THREADS, ip_adapters=(("style", "tiny-flux-ip-adapter"),)
    )
    pipeline = load_pipeline(config)
    assert isinstance(pipeline, DiffusersAdapter)
    requests = packing_pair(pipeline)
    stepped = run_interleaved(pipeline, requests, [0, 0])
    for request in requests:
        (alone,) = stock_output(loaded("tiny-flux"), request).images
        assert difference(stepped[request.request_id].images[0], alone) <= 1


def test_sd3_packs_plain_requests_and_keeps_cached_ones_to_their_size() -> None:
    """SD3 cannot pad (its attention takes no mask): a cached request steps with its size."""
    sd3 = loaded("tiny-sd3")

    def resolved(side: int, cache: CacheChoice | None = None) -> GenerationRequest:
        request = GenerationRequest.create("a cat", SamplingParams(width=side, height=side, cache=cache))
        return request.with_params(sd3.resolve(request))

    plain = {sd3.step_key(resolved(side)) for side in (32, 64)}
    cached = {sd3.step_key(resolved(side, CacheChoice("first-block", 0.2))) for side in (32, 64)}
    assert len(plain) == 1 and len(cached) == 2 and not plain & cached
    assert sd3.step_packs(resolved(32)) and sd3.step_grid(resolved(32)) != ()
    assert not sd3.step_packs(resolved(32, CacheChoice("first-block", 0.2)))
    with patch.object(sd3.family, "config", replace(sd3.config, pack_sizes=False)):  # --mix-sizes pad
        assert len({sd3.step_key(resolved(side)) for side in (32, 64)}) == 2


def test_unet_families_keep_one_step_group_per_size(sd: DiffusersAdapter) -> None:
    requests = [
        GenerationRequest.create("a cat", SamplingParams(width=side, height=side)) for side in (32, 64)
    ]
    keys = {sd.step_key(r.with_params(sd.resolve(r))) for r in requests}
    assert len(keys) == 2
    assert sd.step_grid(requests[0]) == ()


@contextmanager
def preview_decoder(pipeline: DiffusersAdapter, decoder: Literal["vae", "linear"]) -> Iterator[None]:
    """Serve previews with `decoder` (a fresh linear fit) for the duration."""
    config = pipeline.config
    pipeline.config, pipeline.linear_preview = replace(config, preview_decoder=decoder), LinearPreview()
    try:
        yield
    finally:
        pipeline.config, pipeline.linear_preview = config, LinearPreview()


def run_alone(pipeline: DiffusersAdapter, request: GenerationRequest) -> tuple[list[Any], RequestOutput]:
    """One request through the stages alone, decoding each preview as the engine does."""
    (state,) = pipeline.prepare([request])
    previews = []
    while not state.is_done:
        pipeline.step([state])
        if state.preview is not None:
            previews.append((state.steps_done, pipeline.preview([state])[0]))
            state.preview = None
    (output,) = pipeline.finish([state])
    return previews, output


@pytest.mark.parametrize(
    ("model", "scheduler_class"),
    [("tiny-sd", None), ("tiny-sd", DPMSolverMultistepScheduler), ("tiny-qwen-image", None)],
    ids=["sd-own", "sd-DPMSolverMultistepScheduler", "qwen-image-own"],
)
def test_previews_converge_to_the_final_image_and_leave_it_unchanged(
    model: str, scheduler_class: Any
) -> None:
    pipeline = loaded(model)
    assert isinstance(pipeline, DiffusersAdapter)
    original = pipeline.pipe.scheduler
    if scheduler_class is not None:
        pipeline.pipe.scheduler = scheduler_class.from_config(original.config)
    asked = []
    try:
        with preview_decoder(pipeline, "vae"):
            for partial_images in (0, 3):
                params = SamplingParams(num_inference_steps=12, seed=3, n=2, partial_images=partial_images)
                request = GenerationRequest.create("a red cat", params)
                asked.append(run_alone(pipeline, request.with_params(pipeline.resolve(request))))
    finally:
        pipeline.pipe.scheduler = original
    (no_previews, plain), (previews, output) = asked
    assert no_previews == []
    assert [step for step, _ in previews] == [3, 6, 9]
    for plain_image, image in zip(plain.images, output.images, strict=True):
        assert (plain_image == image).all()  # previews change nothing
    for i, final in enumerate(output.images):
        errors = [np.abs(images[i].astype(float) - final.astype(float)).mean() for _, images in previews]
        assert all(images[i].shape == final.shape and images[i].dtype == np.uint8 for _, images in previews)
        # Each estimate of the clean image is closer to the final one than the one before.
        assert errors == sorted(errors, reverse=True) and errors[-1] < errors[0], errors


def denoised(pipeline: DiffusersAdapter, seeds: range, partial_images: int = 0) -> list[Any]:
    """Requests of tiny Qwen-Image taken through their last step, ready to finish."""
    requests = []
    for seed in seeds:
        params = SamplingParams(num_inference_steps=4, seed=seed, partial_images=partial_images)
        request = GenerationRequest.create("a red cat", params)
        requests.append(request.with_params(pipeline.resolve(request)))
    states = pipeline.prepare(requests)
    while not states[0].is_done:
        pipeline.step(states)
    return states


def test_the_linear_preview_explains_the_vaes_colours_on_images_it_never_saw() -> None:
    """Fitted on the final decodes of a few requests, the map predicts the colour of each
    latent pixel's patch of new images far better than their mean colour would (R^2)."""
    pipeline = loaded("tiny-qwen-image")
    assert isinstance(pipeline, DiffusersAdapter)
    with preview_decoder(pipeline, "linear"):
        pipeline.finish(denoised(pipeline, range(8), partial_images=1))  # what the map learns from
        linear = pipeline.linear_preview
        linear.wait()
        states = denoised(pipeline, range(100, 104))
        grid = pipeline.family.latent_grid(states, torch.cat([state.latents for state in states]))
        assert linear is not None and linear.images_seen == 8 and grid is not None
        approx = np.stack(linear.decode(grid, 64, 64)).astype(float)
        final = np.stack([output.images[0] for output in pipeline.finish(states)]).astype(float)
    side = grid.shape[-1]
    patches = final.reshape(4, side, 64 // side, side, 64 // side, 3).mean(axis=(2, 4))
    predicted = approx.reshape(4, side, 64 // side, side, 64 // side, 3).mean(axis=(2, 4))
    r2 = 1 - ((predicted - patches) ** 2).mean() / patches.var()
    assert r2 > 0.3, r2


def test_the_linear_preview_learns_only_from_requests_that_preview_off_the_finishing_thread() -> None:
    """Without previews no final image is copied for the fit; with them, only the previewing
    requests' images are, and the fit runs on a thread of its own."""
    pipeline = loaded("tiny-qwen-image")
    assert isinstance(pipeline, DiffusersAdapter)
    with preview_decoder(pipeline, "linear"):
        linear = pipeline.linear_preview
        fitted_on: list[threading.Thread] = []
        observe = linear.observe

        def recording(grid: torch.Tensor, images: np.ndarray) -> None:
            fitted_on.append(threading.current_thread())
            observe(grid, images)

        linear.observe = recording  # type: ignore[method-assign]
        pipeline.finish(denoised(pipeline, range(2)))
        linear.wait()
        assert linear.images_seen == 0 and fitted_on == []
        pipeline.finish(denoised(pipeline, range(2, 3)) + denoised(pipeline, range(3, 4), partial_images=1))
        linear.wait()
        assert linear.images_seen == 1
        assert len(fitted_on) == 1 and fitted_on[0] is not threading.current_thread()


def test_step_cost_counts_rows_and_latent_tokens(sd: DiffusersAdapter) -> None:
    def cost(**fields: Any) -> int:
        request = GenerationRequest.create("a cat", SamplingParams(width=64, height=128, **fields))
        return sd.step_cost(request.with_params(sd.resolve(request)))

    tokens = (64 // 8) * (128 // 8)
    assert cost(guidance_scale=1.0) == tokens
    assert cost(guidance_scale=7.5) == 2 * tokens  # negative rows too
    assert cost(guidance_scale=7.5, n=3) == 6 * tokens


@pytest.mark.parametrize("model", ["tiny-qwen-image", "tiny-wan-i2v"])
async def test_decoding_beside_the_steps_changes_no_image(model: str) -> None:
    """With decodes on their own thread, beside steps, VAE previews and (for image-to-video)
    VAE encodes of joiners, every request still gets its solo image."""
    pipeline = loaded(model)
    assert isinstance(pipeline, DiffusersAdapter)
    executor = ThreadExecutor(lambda: pipeline, decode_overlap="on")
    engine = AsyncEngine(executor, EngineConfig(max_num_seqs=8, batching="step"))
    requests = [
        replace(r, params=replace(r.params, partial_images=2))
        for r in mixed_requests(pipeline, random.Random(5))
    ]
    with preview_decoder(pipeline, "vae"):
        await engine.start()
        try:
            handles = []
            for request in requests:  # arriving one by one: they join at different steps
                handles.append(engine.submit(request))
                await asyncio.sleep(0)
            served = [await handle.result() for handle in handles]
            runner = executor.step_runner
            assert runner is not None and runner.decodes_beside > 0
        finally:
            await engine.stop()
    for request, output in zip(requests, served, strict=True):
        (alone,) = pipeline.forward(RequestBatch(key=(), requests=(request,)))
        for image, reference in zip(output.images, alone.images, strict=True):
            assert np.abs(image.astype(int) - reference.astype(int)).max() <= 1
