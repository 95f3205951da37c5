"""CFG-parallel on the real tiny models (`pipelines.parallel`): two processes form a lane (gloo
on the CPU), each steps the same mixed group — a guided request with its own scale and a
negative prompt, one without guidance, one joining mid-run — running only its share of each
forward, and every request's images equal its one-device images within 1/255 (CPU float32).
The step matrix of tests/pipelines/test_stepping.py holds the one-device images to diffusers'
own pipeline alone."""

from __future__ import annotations

import multiprocessing
from dataclasses import replace
from typing import Any

import pytest

from engine.request import GenerationRequest, SamplingParams
from pipelines.adapter import DiffusersAdapter
from pipelines.base import PipelineConfig
from pipelines.families.flux2 import Flux2
from pipelines.parallel.seat import LaneShape, lane_seats
from server.composition import load_configured
from tests.pipelines.engines import difference
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


def member(config: PipelineConfig, requests: list[GenerationRequest], answers: Any) -> None:
    """One member of the lane: load, join, step the group, send (its outputs, rows it ran)."""
    pipeline: Any = load_configured(config)
    rows = [0]
    denoise = pipeline.family.denoise

    def counted(states: list[Any], latents: Any, *rest: Any) -> Any:
        rows[0] += latents.shape[0]
        return denoise(states, latents, *rest)

    pipeline.family.denoise = counted
    outputs = run_interleaved(pipeline, requests, JOINS)
    answers.put((config.lane.rank if config.lane else -1, outputs, rows[0]))


@pytest.mark.parametrize("model", FAMILIES)
def test_each_request_under_cfg_parallel_equals_its_one_device_image(model: str) -> None:
    pipeline = loaded(model)
    requests = mixed_group(pipeline)
    assert [pipeline.family.uses_cfg(r) for r in requests] == [True, False, True]
    rows_alone = [0]
    denoise = pipeline.family.denoise

    def counted(states: list[Any], latents: Any, *rest: Any) -> Any:
        rows_alone[0] += latents.shape[0]
        return denoise(states, latents, *rest)

    pipeline.family.denoise = counted  # type: ignore[method-assign,assignment]
    try:
        alone = run_interleaved(pipeline, requests, JOINS)
    finally:
        del pipeline.family.denoise
    split = run_lane(replace(pipeline.config, num_threads=1), requests)
    (lead_outputs, lead_rows), (helper_outputs, helper_rows) = split[0], split[1]
    # Each device ran part of every forward, and together every row once.
    assert 0 < helper_rows < rows_alone[0] and lead_rows + helper_rows == rows_alone[0]
    # Only the lead decodes.
    assert all(output.images == () for output in helper_outputs.values())
    for request in requests:
        got, expected = lead_outputs[request.request_id], alone[request.request_id]
        assert got.seeds == expected.seeds
        for image, reference in zip(got.images, expected.images, strict=True):
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
