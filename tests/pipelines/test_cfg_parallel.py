"""CFG-parallel on the real tiny models (`pipelines.parallel`): two processes form a lane (gloo
on the CPU), each steps the same mixed group — a guided request with its own scale and a
negative prompt, one without guidance, one joining mid-run — running only its share of each
forward, and every request's images equal its one-device images within 1/255 (CPU float32).
The step matrix of tests/pipelines/test_stepping.py holds the one-device images to diffusers'
own pipeline alone. FLUX's lane then steps a group under the step caches in the same
processes: each request decides over all its rows, whichever device holds them, and its
images and skips are its one-device ones."""

from __future__ import annotations

import functools
import multiprocessing
from dataclasses import replace
from typing import Any
from unittest.mock import patch

import pytest

from engine.request import CacheChoice, GenerationRequest, SamplingParams
from pipelines.adapter import DiffusersAdapter
from pipelines.base import PipelineConfig
from pipelines.families.flux2 import Flux2
from pipelines.parallel.seat import LaneShape, lane_seats
from server.composition import load_configured
from tests.pipelines.engines import difference
from tests.pipelines.test_controlnet import CONTROLLED_JOINS, controlled_group, served
from tests.pipelines.test_stepping import loaded, run_interleaved

pytestmark = pytest.mark.slow

# (model, per-request guidance: the guided request's own scales) of each family covered.
FAMILIES = ["tiny-sd", "tiny-flux"]
JOINS = [0, 0, 2]  # the third request joins at the third step
CFG_PARALLEL = LaneShape(cfg=2)


def mixed_group(pipeline: DiffusersAdapter) -> list[GenerationRequest]:
    """A guided request (its own scale, a negative prompt where the family takes one: FLUX.2
    does not), one without guidance, and a guided one that joins later (true CFG needs its
    negative prompt); prompts of different lengths; 9 frames of a video."""
    true_cfg = pipeline.default_true_cfg_scale is not None
    negatives = not isinstance(pipeline.family, Flux2)
    frames = 9 if pipeline.modality == "video" else None
    shapes: list[dict[str, Any]] = [
        dict(guidance_scale=6.0, true_cfg_scale=3.0 if true_cfg else None, negative_prompt="blurry, dark"),
        dict(guidance_scale=1.0, true_cfg_scale=1.0 if true_cfg else None, negative_prompt=None),
        dict(guidance_scale=3.0, true_cfg_scale=2.0 if true_cfg else None, negative_prompt="grey"),
    ]
    requests = []
    for i, shape in enumerate(shapes):
        shape["negative_prompt"] = shape["negative_prompt"] if negatives else None
        params = SamplingParams(
            num_inference_steps=4, width=32, height=32, num_frames=frames, seed=11 + i, **shape
        )
        request = GenerationRequest.create("a red cat" + " on the moon" * i, params)
        requests.append(request.with_params(pipeline.resolve(request)))
    return requests


def cached_group(pipeline: DiffusersAdapter) -> tuple[list[GenerationRequest], list[int]]:
    """The requests of `mixed_group` over 8 steps under First-Block Cache at thresholds that
    skip some of their steps and not others (the guided ones' rows on both CFG shares, the
    unguided one's on the lead), and an unguided one under TaylorSeer; their joins."""
    thresholds = (0.3, 0.45, 0.6)
    requests = []
    for request, threshold in zip(mixed_group(pipeline), thresholds, strict=True):
        params = replace(request.params, num_inference_steps=8, cache=CacheChoice("first-block", threshold))
        requests.append(request.with_params(params))
    taylor = SamplingParams(
        num_inference_steps=8,
        width=32,
        height=32,
        seed=20,
        guidance_scale=1.0,
        cache=CacheChoice("taylorseer"),
    )
    request = GenerationRequest.create("a green cat", taylor)
    requests.append(request.with_params(pipeline.resolve(request)))
    return requests, [0, 0, 2, 1]


Skips = dict[str, tuple[int | None, int | None]]


def skips_of(state: Any) -> tuple[int | None, int | None]:
    """A finished request's steps skipped: by First-Block Cache, by TaylorSeer (None: not used)."""
    cache, taylor = state.cache, state.taylor_seer
    return (None if cache is None else cache.steps_skipped, None if taylor is None else taylor.steps_skipped)


def run_counted(
    pipeline: Any, requests: list[GenerationRequest], joins: list[int]
) -> tuple[dict[str, Any], int, Skips]:
    """`run_interleaved`, with the rows the family's denoiser was given and each request's
    steps skipped (`skips_of`) as this device's states hold them at their finish."""
    rows = [0]
    denoise, finish = pipeline.family.denoise, pipeline.finish
    skips: Skips = {}

    def counted(states: list[Any], latents: Any, *rest: Any) -> Any:
        rows[0] += latents.shape[0]
        return denoise(states, latents, *rest)

    def finished(states: list[Any]) -> Any:
        skips.update({state.request.request_id: skips_of(state) for state in states})
        return finish(states)

    with patch.object(pipeline.family, "denoise", counted), patch.object(pipeline, "finish", finished):
        outputs = run_interleaved(pipeline, requests, joins)
    return outputs, rows[0], skips


def member(config: PipelineConfig, groups: list[tuple[Any, ...]], answers: Any) -> None:
    """One member of the lane: load, join, step each group (requests, joins) in turn, send
    (its rank, and for each group its outputs, the rows it ran and its requests' skips)."""
    pipeline: Any = load_configured(config)
    ran = [run_counted(pipeline, requests, joins) for requests, joins in groups]
    answers.put((config.lane.rank if config.lane else -1, ran))


@functools.cache
def groups_of(model: str) -> list[tuple[list[GenerationRequest], list[int]]]:
    """The groups a model's lane steps: the mixed group, and for FLUX the cached one."""
    pipeline = loaded(model)
    groups = [(mixed_group(pipeline), JOINS)]
    return groups + ([cached_group(pipeline)] if model == "tiny-flux" else [])


@functools.cache
def one_device(model: str) -> list[tuple[dict[str, Any], int, Skips]]:
    """What `run_counted` gives for each group of `groups_of` on one device."""
    return [run_counted(loaded(model), requests, joins) for requests, joins in groups_of(model)]


@functools.cache
def cfg_lane(model: str) -> dict[int, Any]:
    """Rank -> what `member` answered, every group of `groups_of` stepped in one CFG lane."""
    config = replace(loaded(model).config, num_threads=1)
    seats = lane_seats(CFG_PARALLEL)
    answers = spawned(member, [(replace(config, lane=seat), groups_of(model)) for seat in seats], len(seats))
    return dict(answers)


@pytest.mark.parametrize("model", FAMILIES)
def test_each_request_under_cfg_parallel_equals_its_one_device_image(model: str) -> None:
    requests = groups_of(model)[0][0]
    assert [loaded(model).family.uses_cfg(r) for r in requests] == [True, False, True]
    alone, rows_alone, _ = one_device(model)[0]
    lane = cfg_lane(model)
    (lead_outputs, lead_rows, _), (helper_outputs, helper_rows, _) = lane[0][0], lane[1][0]
    # Each device ran part of every forward, and together every row once.
    assert 0 < helper_rows < rows_alone and lead_rows + helper_rows == rows_alone
    # Only the lead decodes.
    assert all(output.images == () for output in helper_outputs.values())
    for request in requests:
        got, expected = lead_outputs[request.request_id], alone[request.request_id]
        assert got.seeds == expected.seeds
        for image, reference in zip(got.images, expected.images, strict=True):
            assert difference(image, reference) <= 1, request.params


def test_each_cached_request_under_cfg_parallel_skips_and_draws_as_on_one_device() -> None:
    """First-Block Cache and TaylorSeer in a CFG lane: the guided requests' rows split between
    the two devices; each request's skips are its one-device ones on each device that holds
    its rows (a guided request's decision reads both devices' rows), and so are its images."""
    requests, _ = groups_of("tiny-flux")[1]
    alone, rows_alone, skips_alone = one_device("tiny-flux")[1]
    lane = cfg_lane("tiny-flux")
    (lead_outputs, lead_rows, lead_skips), (_, helper_rows, helper_skips) = lane[0][1], lane[1][1]
    assert 0 < helper_rows < rows_alone and lead_rows + helper_rows == rows_alone
    first_block = [skips[0] for skips in skips_alone.values() if skips[0] is not None]
    assert any(0 < skipped < 7 for skipped in first_block), "no request skipped some steps, not all"
    family = loaded("tiny-flux").family
    for request in requests:
        rid = request.request_id
        assert lead_skips[rid] == skips_alone[rid], request.params
        if family.uses_cfg(request) or skips_alone[rid][1] is not None:  # rows (or series) on both
            assert helper_skips[rid] == skips_alone[rid], request.params
        for image, reference in zip(lead_outputs[rid].images, alone[rid].images, strict=True):
            assert difference(image, reference) <= 1, request.params


def run_lane(
    config: PipelineConfig,
    requests: list[GenerationRequest],
    shape: LaneShape = CFG_PARALLEL,
    target: Any = member,
) -> dict[int, tuple[Any, ...]]:
    """What each member (`target`, in a spawned process per seat) answered after its rank:
    (outputs, denoiser rows) from `member`."""
    seats = lane_seats(shape)
    answers = spawned(target, [(replace(config, lane=seat), requests) for seat in seats], len(seats))
    return {rank: tuple(answer) for rank, *answer in answers}


def spawned(target: Any, member_args: list[tuple[Any, ...]], count: int) -> list[tuple[Any, ...]]:
    """The first `count` answers of processes running `target(*args, answers)`, one spawned
    per entry of `member_args`."""
    context = multiprocessing.get_context("spawn")
    answers = context.Queue()
    members = [context.Process(target=target, args=(*args, answers), daemon=True) for args in member_args]
    for process in members:
        process.start()
    try:
        return [answers.get(timeout=300) for _ in range(count)]
    finally:
        for process in members:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()


def test_controlled_requests_under_cfg_parallel_equal_their_one_device_images() -> None:
    """Stable Diffusion's ControlNets in a CFG lane (`Family.splits_cfg_with_controlnet`): each
    device runs the ControlNets on the rows it holds, with their own branch's text. The
    ControlNet step matrix's group (plain, guided under one ControlNet, windowed, two
    ControlNets joining later): each image is its one-device image."""
    sd = served("tiny-sd")
    requests, joins = controlled_group(sd), CONTROLLED_JOINS
    expected = run_interleaved(sd, requests, joins)
    config = replace(sd.config, num_threads=1)
    seats = lane_seats(CFG_PARALLEL)
    answers = dict(spawned(member, [(replace(config, lane=seat), [(requests, joins)]) for seat in seats], 2))
    (lead,) = answers[0]
    outputs, rows, _ = lead
    assert rows > 0 and all(output.images == () for output in answers[1][0][0].values())
    for controlled in requests:
        for image, reference in zip(
            outputs[controlled.request_id].images, expected[controlled.request_id].images, strict=True
        ):
            assert difference(image, reference) <= 1, controlled.params


def failing_member(config: PipelineConfig, requests: list[GenerationRequest], answers: Any) -> None:
    """A member of a CFG lane whose denoiser raises on member 1 only: send (its rank, the
    error its step raised)."""
    pipeline: Any = load_configured(config)
    assert config.lane is not None
    if config.lane.rank == 1:

        def fail(*_: Any) -> None:
            raise RuntimeError("an injected failure on member 1")

        pipeline.pipe.unet.register_forward_pre_hook(fail)
    try:
        run_interleaved(pipeline, requests, [0] * len(requests))
    except Exception as exc:  # noqa: BLE001 - the error is the answer
        answers.put((config.lane.rank, type(exc).__name__))


def test_a_forward_that_raises_on_one_share_of_a_cfg_lane_raises_on_both_and_the_lane_stays() -> None:
    """A CFG lane without a request under First-Block Cache has no exchange inside its
    forward: a share that raises tells the other at the agreement after it, and both raise
    (so the stage runner retries the same halves on each), where a lane with an exchange
    inside must end its members and restart."""
    sd = loaded("tiny-sd")
    config = replace(sd.config, num_threads=1)
    seats, requests = lane_seats(CFG_PARALLEL), mixed_group(sd)  # the same ids on both
    answers = dict(spawned(failing_member, [(replace(config, lane=seat), requests) for seat in seats], 2))
    assert answers == {0: "PeerStepError", 1: "RuntimeError"}
