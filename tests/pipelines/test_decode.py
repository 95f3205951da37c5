"""A decode that runs out of memory is retried in halves on the latents already made: the
denoise runs once, and every request still gets its own images."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np
import pytest
import torch
from diffusers.models.autoencoders.vae import DecoderOutput

from engine.outputs import fitting_images
from engine.request import GenerationRequest, RequestBatch, SamplingParams
from engine.sched import scheduler, step_budget
from engine.worker.forward import run_batch
from pipelines.base import PipelineConfig
from pipelines.decode import RAISE_AFTER_FITS, HalvingDecode
from tests.pipelines.custom import DecodeLimitedTextToImage
from tests.threads import THREADS

STEPS = 2


def oom_above(limit: int, calls: list[int]) -> Callable[..., object]:
    def decode(z: torch.Tensor, temb: torch.Tensor | None = None, return_dict: bool = True) -> object:
        calls.append(z.shape[0])
        if z.shape[0] > limit:
            raise torch.OutOfMemoryError("out of memory")
        out = z * 2 if temb is None else z + temb[:, None]
        return (out,) if not return_dict else DecoderOutput(sample=out)

    return decode


def test_an_out_of_memory_decode_is_retried_in_halves_and_remembered() -> None:
    calls: list[int] = []
    decode = HalvingDecode(oom_above(2, calls))
    z = torch.arange(5.0).reshape(5, 1)
    assert torch.equal(decode(z, return_dict=False)[0], z * 2)
    assert calls == [5, 2, 3, 1, 2]
    calls.clear()
    # Learned: a decode as large as one that ran out of memory is cut up front.
    assert torch.equal(decode(z).sample, z * 2)
    assert calls == [2, 1, 2]


def test_what_ran_out_of_memory_caps_only_decodes_of_its_own_image_size() -> None:
    calls: list[int] = []

    def oom_large(z: torch.Tensor, return_dict: bool = True) -> object:
        calls.append(z.shape[0])
        if z.shape[0] * z[0].numel() > 2 * 64:  # memory for 2 images of 64 elements
            raise torch.OutOfMemoryError("out of memory")
        return DecoderOutput(sample=z)

    decode = HalvingDecode(oom_large)
    decode(torch.zeros(4, 64))
    assert calls == [4, 2, 2] and decode.out_of_memory == 1
    calls.clear()
    # Small images (16 elements each) were never short of memory: decoded whole.
    decode(torch.zeros(8, 16))
    assert calls == [8]


def test_a_decode_cap_rises_again_after_decodes_at_it_fit() -> None:
    calls: list[int] = []
    limit = [1]

    def oom_above_limit(z: torch.Tensor, return_dict: bool = True) -> object:
        calls.append(z.shape[0])
        if z.shape[0] > limit[0]:
            raise torch.OutOfMemoryError("out of memory")
        return DecoderOutput(sample=z)

    decode = HalvingDecode(oom_above_limit)
    decode(torch.zeros(2, 1))
    assert calls == [2, 1, 1]
    limit[0] = 8  # memory is back (another process exited)
    for _ in range(RAISE_AFTER_FITS - 1):
        decode(torch.zeros(2, 1))
    calls.clear()
    decode(torch.zeros(2, 1))
    assert calls == [1, 1]  # still cut: the last fit at the cap makes it rise
    calls.clear()
    decode(torch.zeros(2, 1))
    assert calls == [2] and decode.out_of_memory == 1


def test_decode_caps_rise_with_the_same_patience_as_the_engines_learnt_limits() -> None:
    assert RAISE_AFTER_FITS == step_budget.RAISE_AFTER_FITS == scheduler.RAISE_CAP_AFTER


def test_per_image_arguments_are_split_with_the_latents() -> None:
    calls: list[int] = []
    decode = HalvingDecode(oom_above(1, calls))
    z, temb = torch.zeros(3, 1), torch.tensor([1.0, 2.0, 3.0])
    assert decode(z, temb, return_dict=False)[0].flatten().tolist() == [1.0, 2.0, 3.0]


def test_other_failures_and_a_single_image_out_of_memory_are_raised() -> None:
    def broken(z: torch.Tensor, **kwargs: object) -> object:
        raise ValueError("not a memory problem")

    with pytest.raises(ValueError):
        HalvingDecode(broken)(torch.zeros(4, 1))
    with pytest.raises(torch.OutOfMemoryError):
        HalvingDecode(oom_above(0, []))(torch.zeros(1, 1))


@pytest.mark.slow
def test_a_request_level_forward_whose_decode_runs_out_of_memory_denoises_once() -> None:
    pipeline = DecodeLimitedTextToImage.load(PipelineConfig(model="tiny-sd", num_threads=THREADS))
    params = SamplingParams(width=64, height=64, num_inference_steps=STEPS, guidance_scale=7.5)
    requests = [
        GenerationRequest.create(prompt, replace(params, seed=seed, n=n))
        for prompt, seed, n in (("a cat", 1, 1), ("a dog", 2, 2), ("a castle", 3, 1))
    ]
    key = pipeline.batch_key(requests[0])
    result = run_batch(pipeline, RequestBatch(key=key, requests=tuple(requests)))
    assert not result.errors and list(result.outputs) == [r.request_id for r in requests]
    # One forward, denoised once: 4 images, with classifier-free guidance 2 rows each.
    assert len(result.forwards) == 1 and result.forwards[0].ok
    assert pipeline.denoised_rows == STEPS * 2 * 4
    assert fitting_images(result.forwards) is None  # nothing for the scheduler to learn
    # ...but the halved decode is counted, for /metrics.
    assert result.decode_out_of_memory >= 1 and pipeline.decode_out_of_memory() >= 1
    for request in requests:
        alone = run_batch(pipeline, RequestBatch(key=key, requests=(request,))).outputs[request.request_id]
        together = result.outputs[request.request_id]
        assert len(together.images) == request.params.n
        for mine, solo in zip(together.images, alone.images, strict=True):
            assert np.abs(mine.astype(np.int16) - solo.astype(np.int16)).max() <= 1
