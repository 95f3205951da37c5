"""LTX-2 step-level: requests with their own steps, guidance and negatives share iterations of
up to three transformer forwards (every row; the positive rows with the spatio-temporal
guidance blocks perturbed; the positive rows with the modalities isolated), and each video
and its audio track equal the stock pipeline's for it alone. The stepping matrix of
`test_stepping` runs on `tiny-ltx2` too."""

from __future__ import annotations

from typing import Any
from unittest.mock import patch

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler

from engine.request import GenerationRequest, RequestBatch, SamplingParams
from pipelines.families.ltx2 import LTX2
from tests.pipelines.engines import difference
from tests.pipelines.test_stepping import loaded

pytestmark = pytest.mark.slow

# The tiny transformer has two blocks: the stock default (block 28) perturbs none of them.
_PERTURBED_BLOCKS = [1]


def test_requests_share_three_passes_a_step_and_each_matches_alone() -> None:
    """A 3-step request guided at 4 and a 5-step one at 1 with a negative prompt and n = 2,
    with spatio-temporal guidance on a block the tiny model has: every iteration is one
    forward over all rows, one over the positive rows with that block perturbed and one over
    them with the modalities isolated; each video and audio track equals its stock run."""
    pipeline = loaded("tiny-ltx2")
    family, pipe = pipeline.family, pipeline.pipe
    assert isinstance(family, LTX2)
    params = [
        SamplingParams(num_inference_steps=3, guidance_scale=4.0, num_frames=9, seed=1),
        SamplingParams(
            num_inference_steps=5, guidance_scale=1.0, negative_prompt="noise", num_frames=9, n=2, seed=2
        ),
    ]
    requests = []
    for i, p in enumerate(params):
        request = GenerationRequest.create(f"rain on a roof {i}", p)
        requests.append(request.with_params(pipeline.resolve(request)))
    calls: list[tuple[int, bool, bool]] = []
    first_outputs: list[torch.Tensor] = []

    def record(module: torch.nn.Module, args: Any, kwargs: dict[str, Any], output: Any) -> None:
        stg = bool(kwargs["spatio_temporal_guidance_blocks"])
        calls.append((int(kwargs["hidden_states"].shape[0]), stg, bool(kwargs["isolate_modalities"])))
        first_outputs.append(output[0])

    stock_default, stock_call_kwargs = family._default, family.call_kwargs

    def default(name: str) -> Any:
        return _PERTURBED_BLOCKS if name == "spatio_temporal_guidance_blocks" else stock_default(name)

    def call_kwargs(p: SamplingParams) -> dict[str, Any]:
        return {**stock_call_kwargs(p), "spatio_temporal_guidance_blocks": _PERTURBED_BLOCKS}

    with patch.object(family, "_default", default), patch.object(family, "call_kwargs", call_kwargs):
        states = pipeline.prepare(requests)
        handle = pipe.transformer.register_forward_hook(record, with_kwargs=True)
        try:
            running, iterations = list(states), 0
            while running:
                pipeline.step(running)
                iterations += 1
                running = [state for state in running if not state.is_done]
        finally:
            handle.remove()
        outputs = pipeline.finish(states)
        alone = [pipeline.forward(RequestBatch(key=(), requests=(r,)))[0] for r in requests]
    assert iterations == 5  # both step together while both run
    # The audio guidance (7) keeps CFG on for both: negative and positive rows (1 x 2 + 2 x 2),
    # then each pass over the positive rows (1 + 2).
    both = [(6, False, False), (3, True, False), (3, False, True)]
    second = [(4, False, False), (2, True, False), (2, False, True)]
    assert calls == both * 3 + second * 2
    # The perturbed block moves the first request's prediction (its positive row is row 1 of
    # the first forward, row 0 of the perturbed one).
    assert not torch.allclose(first_outputs[0][1], first_outputs[1][0])
    for output, reference in zip(outputs, alone, strict=True):
        assert len(output.images) == len(output.extras["audio"]) == len(reference.images)
        for video, expected in zip(output.images, reference.images, strict=True):
            assert difference(video, expected) <= 1
        for audio, expected in zip(output.extras["audio"], reference.extras["audio"], strict=True):
            assert audio.shape == expected.shape and audio.shape[0] == 2
            np.testing.assert_allclose(audio, expected, rtol=0, atol=1e-3)
    assert outputs[0].extras["sample_rate"] == [16000]


@pytest.mark.parametrize(
    "scheduler",
    [UniPCMultistepScheduler(), FlowMatchEulerDiscreteScheduler(stochastic_sampling=True)],
    ids=["multistep", "stochastic"],
)
def test_a_scheduler_other_than_plain_flow_euler_is_served_request_level(scheduler: Any) -> None:
    """Video and audio step as one row of one scheduler only with the plain flow-matching
    Euler step; another scheduler keeps the stock call's two (request level)."""
    pipeline = loaded("tiny-ltx2")
    original = pipeline.pipe.scheduler
    assert pipeline.supports_step_batch
    pipeline.pipe.scheduler = scheduler
    try:
        assert not pipeline.supports_step_batch
    finally:
        pipeline.pipe.scheduler = original


def test_the_step_key_holds_what_fixes_the_audio_and_positions() -> None:
    """Size, frames and frame rate fix the video tokens, the audio length and the positions:
    in the step key. Steps, guidance and the negative prompt are not."""
    pipeline = loaded("tiny-ltx2")

    def key(**changes: Any) -> Any:
        request = GenerationRequest.create("x", SamplingParams(**{"num_frames": 9, **changes}))
        return pipeline.step_key(request.with_params(pipeline.resolve(request)))

    base = key()
    assert key(num_inference_steps=7, guidance_scale=1.0, negative_prompt="y") == base
    assert len({base, key(fps=12), key(num_frames=17), key(width=64)}) == 4


def test_the_step_cost_counts_every_pass_and_the_audio() -> None:
    """A step runs the rows with and without the prompt, then the positive rows again
    perturbed and isolated (the stock defaults turn both on): four rows per image, each
    carrying its audio latents beside its video ones."""
    pipeline = loaded("tiny-ltx2")
    family = pipeline.family
    assert isinstance(family, LTX2)
    params = SamplingParams(num_inference_steps=2, num_frames=9, width=64, height=64, n=2)
    request = GenerationRequest.create("rain", params)
    request = request.with_params(pipeline.resolve(request))
    layout = family.layout(request.params)
    units = 8 * 8 * 3  # 64x64 in 8x8 patches, 9 frames in 3 latent frames
    row = units + layout.audio_frames * units // layout.video_tokens
    assert layout.audio_frames > 0
    assert pipeline.step_cost(request) == 2 * 4 * row

    stock_default = family._default
    plain = {"stg_scale": 0.0, "audio_stg_scale": 0.0, "modality_scale": 1.0, "audio_modality_scale": 1.0}
    with patch.object(family, "_default", lambda name: plain.get(name, stock_default(name))):
        assert pipeline.step_cost(request) == 2 * 2 * row  # the two guidance passes off
