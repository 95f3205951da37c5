"""Wan 2.2 A14B step-level: requests whose expert switches fall at different steps share
iterations (one forward per expert present), and each video equals the stock pipeline's for
it alone, with each request's own `guidance_scale_2` for its low-noise steps."""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any

import pytest
import torch

from engine.request import GenerationRequest, InvalidRequestError, RequestBatch, SamplingParams
from pipelines.adapter import DiffusersAdapter
from pipelines.base import PipelineConfig
from pipelines.registry import load_pipeline
from tests.pipelines.engines import difference
from tests.pipelines.test_stepping import loaded, mixed_requests, stepped_matches_alone
from tests.threads import THREADS

pytestmark = pytest.mark.slow

TI2V_IMAGE_TO_VIDEO = "pipelines.registry:WanImageToVideo"


def with_second_guidance(pipeline: DiffusersAdapter, rng: random.Random) -> list[GenerationRequest]:
    """The stepping matrix, the low-noise expert guided differently per request (1.0: none
    for those steps, though the request still runs its negative rows, as diffusers does)."""
    requests = mixed_requests(pipeline, rng)
    seconds = [2.0, 6.0, 1.0, None, 4.0]
    return [
        request.with_params(replace(request.params, guidance_scale_2=second))
        if second is not None
        else request
        for request, second in zip(requests, seconds, strict=True)
    ]


@pytest.mark.parametrize("model", ["tiny-wan22", "tiny-wan22-i2v"])
def test_each_request_matches_alone_with_its_own_guidance_scale_2(model: str) -> None:
    stepped_matches_alone(loaded(model), None, with_second_guidance)


def test_ti2v_image_to_video_matches_alone() -> None:
    """TI2V-5B's weights served for image-to-video (`from_pipe`): each request's first latent
    frame held at its own image's latents, its tokens at timestep 0."""
    config = PipelineConfig(model="tiny-wan22-ti2v", pipeline_class=TI2V_IMAGE_TO_VIDEO, num_threads=THREADS)
    pipeline = load_pipeline(config)
    assert isinstance(pipeline, DiffusersAdapter) and pipeline.supports_step_batch
    assert pipeline.input_image_count == (1, 1)
    stepped_matches_alone(pipeline, None, mixed_requests)


def test_ti2v_image_to_video_keeps_the_weights_as_loaded() -> None:
    """Its `WanImageToVideoPipeline` shares the loaded components: `from_pipe` would cast a
    bfloat16 model (and per-component dtypes, quantized weights) to float32."""
    config = PipelineConfig(
        model="tiny-wan22-ti2v", pipeline_class=TI2V_IMAGE_TO_VIDEO, dtype="bfloat16", num_threads=THREADS
    )
    pipe = load_pipeline(config).pipe  # type: ignore[attr-defined]
    assert type(pipe).__name__ == "WanImageToVideoPipeline" and pipe.config.expand_timesteps
    assert {pipe.transformer.dtype, pipe.text_encoder.dtype, pipe.vae.dtype} == {torch.bfloat16}


def test_two_requests_switching_at_different_steps_share_iterations() -> None:
    """A 4-step and a 7-step request (switches at different steps of their own, so at
    different iterations) joined together: the iterations where one is past its boundary
    and the other not run one forward of each expert, each over its own rows; every
    iteration is one `step` for both; and each video equals its stock run alone."""
    pipeline = loaded("tiny-wan22")
    pipe = pipeline.pipe
    params = [
        SamplingParams(num_inference_steps=4, guidance_scale=4.0, guidance_scale_2=3.0, num_frames=9, seed=1),
        SamplingParams(num_inference_steps=7, guidance_scale=5.0, guidance_scale_2=2.0, num_frames=9, seed=2),
    ]
    requests = []
    for i, p in enumerate(params):
        request = GenerationRequest.create(f"a boat {i}", p)
        requests.append(request.with_params(pipeline.resolve(request)))
    states = pipeline.prepare(requests)
    switches = [state.switch_step for state in states]
    assert switches[0] != switches[1], switches
    # Rows per forward, per expert, in call order.
    calls: dict[str, list[int]] = {"transformer": [], "transformer_2": []}

    def counting(name: str) -> Any:
        def hook(module: torch.nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
            calls[name].append(int(kwargs["hidden_states"].shape[0]))

        return hook

    handles = [
        getattr(pipe, name).register_forward_pre_hook(counting(name), with_kwargs=True) for name in calls
    ]
    try:
        iterations = 0
        running = list(states)
        while running:
            pipeline.step(running)
            iterations += 1
            running = [state for state in running if not state.is_done]
    finally:
        for handle in handles:
            handle.remove()
    assert iterations == 7  # one step of both per iteration while both run, not 4 + 7
    # Both use CFG: 2 rows each; request r runs the high-noise expert while i < its switch.
    expected: dict[str, list[int]] = {"transformer": [], "transformer_2": []}
    both_experts = 0
    for i in range(iterations):
        rows = {"transformer": 0, "transformer_2": 0}
        for state, steps in zip(states, (4, 7), strict=True):
            if i < steps:
                rows["transformer" if i < state.switch_step else "transformer_2"] += 2
        for name, count in rows.items():
            if count:
                expected[name].append(count)
        both_experts += all(rows.values())
    assert calls == expected
    assert both_experts >= 1, switches  # an iteration with one forward of each expert
    assert 4 in calls["transformer"]  # and forwards that held both requests' rows
    for request, output in zip(requests, pipeline.finish(states), strict=True):
        (alone,) = pipeline.forward(RequestBatch(key=(), requests=(request,)))
        for video, reference in zip(output.images, alone.images, strict=True):
            assert difference(video, reference) <= 1


def test_guidance_scale_2_defaults_and_is_refused_where_there_is_one_expert() -> None:
    wan22 = loaded("tiny-wan22")
    request = GenerationRequest.create("x", SamplingParams(guidance_scale=4.5, num_frames=9))
    assert wan22.resolve(request).guidance_scale_2 == 4.5  # diffusers' default: the same scale
    wan21 = loaded("tiny-wan")
    params = wan21.resolve(GenerationRequest.create("x", SamplingParams(guidance_scale_2=3.0, num_frames=9)))
    with pytest.raises(InvalidRequestError) as raised:
        wan21.validate(params)
    assert raised.value.param == "guidance_scale_2"


def test_a_vae_that_compresses_16x_costs_a_quarter_of_the_step_tokens() -> None:
    ti2v, wan22 = loaded("tiny-wan22-ti2v"), loaded("tiny-wan22")
    request = GenerationRequest.create(
        "x", SamplingParams(num_frames=9, width=64, height=64, guidance_scale=4.0)
    )
    costs = [pipeline.step_cost(request.with_params(pipeline.resolve(request))) for pipeline in (ti2v, wan22)]
    assert costs[0] * 4 == costs[1]
