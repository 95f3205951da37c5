"""`--decode-budget`: finishers decoded in pieces no larger than the budget, the budget being
the starting cap of `HalvingDecode` (what runs out of memory lowers it, never the denoise
again), and `--vae-tiling auto` tiling only an image that alone is above it."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch

from engine.request import GenerationRequest, RequestBatch, SamplingParams
from engine.worker.forward import run_batch
from pipelines.base import PipelineConfig
from pipelines.decode import HalvingDecode
from pipelines.memory.decode_budget import DecodeBudget
from pipelines.memory.options import MemoryConfig
from tests.pipelines.custom import DecodeLimitedTextToImage
from tests.pipelines.engines import difference
from tests.pipelines.test_decode import oom_above
from tests.pipelines.test_stepping import run_interleaved
from tests.threads import THREADS


class FakeVae:
    use_tiling = False

    def enable_tiling(self) -> None:
        self.use_tiling = True


def test_a_decode_above_the_budget_is_cut_into_pieces_it_allows() -> None:
    calls: list[int] = []
    budget = DecodeBudget(pixels=2 * 64 * 64, spatial=8, temporal=4)
    decode = HalvingDecode(oom_above(8, calls), budget)
    latents = torch.arange(7 * 4 * 8 * 8, dtype=torch.float32).reshape(7, 4, 8, 8)  # 7 images of 64²
    out = decode(latents)
    assert calls == [2, 2, 2, 1] and torch.equal(out.sample, latents * 2)
    assert decode.out_of_memory == 0
    # Smaller images: more of them per piece.
    calls.clear()
    decode(torch.zeros(7, 4, 4, 4))  # 32² each: 8 fit
    assert calls == [7]


def test_running_out_of_memory_under_the_budget_still_halves_and_learns() -> None:
    calls: list[int] = []
    decode = HalvingDecode(oom_above(1, calls), DecodeBudget(pixels=4 * 64 * 64, spatial=8, temporal=4))
    decode(torch.zeros(8, 4, 8, 8))
    # Pieces of 4 (the budget), each of which ran out and was halved, then halved again.
    assert calls[:4] == [4, 2, 1, 1] and decode.out_of_memory >= 1
    assert decode.too_many(torch.zeros(1, 4, 8, 8)) == 2


def test_video_budgets_count_frames_and_an_image_alone_above_it_is_tiled() -> None:
    vae = FakeVae()
    budget = DecodeBudget(pixels=2 * 17 * 64 * 64, spatial=8, temporal=4, vae=vae)
    video = torch.zeros(3, 16, 5, 8, 8)  # 5 latent frames: 17 frames of 64²
    assert budget.item_pixels(video) == 17 * 64 * 64 and budget.images(video) == 2
    seen: list[bool] = []

    def decode(z: torch.Tensor) -> torch.Tensor:
        seen.append(vae.use_tiling)
        return z

    HalvingDecode(decode, budget)(video)
    assert seen == [False, False]
    HalvingDecode(decode, budget)(torch.zeros(1, 16, 5, 16, 16))  # one video at 128²: above it alone
    assert seen[-1] is True and vae.use_tiling is False  # tiled for that decode only


def test_the_budget_is_read_from_the_pipeline() -> None:
    class Pipe:
        vae_scale_factor_spatial = 16
        vae_scale_factor_temporal = 4
        vae = FakeVae()

    budget = DecodeBudget.of(Pipe(), MemoryConfig(decode_budget=1000, vae_tiling="off"))
    assert budget is not None and (budget.spatial, budget.temporal, budget.vae) == (16, 4, None)
    assert DecodeBudget.of(Pipe(), MemoryConfig()) is None


def budgeted(images: int, limit: int) -> DecodeLimitedTextToImage:
    class Limited(DecodeLimitedTextToImage):
        decode_limit = limit

    memory = MemoryConfig(decode_budget=images * 64 * 64)
    return Limited.load(PipelineConfig(model="tiny-sd", num_threads=THREADS, memory=memory))


def four_requests(pipeline: Any) -> list[GenerationRequest]:
    params = SamplingParams(width=64, height=64, num_inference_steps=2, guidance_scale=7.5)
    made = []
    for prompt, seed, n in (("a cat", 1, 1), ("a dog", 2, 2), ("a castle", 3, 1)):
        request = GenerationRequest.create(prompt, replace(params, seed=seed, n=n))
        made.append(request.with_params(pipeline.resolve(request)))
    return made


@pytest.mark.slow
@pytest.mark.parametrize("budget_images", [2, 3])
def test_a_decode_that_fails_above_n_images_never_denoises_twice(budget_images: int) -> None:
    """A VAE that runs out of memory above 2 images: with a budget of 2 no decode fails; with
    a budget of 3 the first one does and is halved. Either way, in both batching modes, each
    request is denoised once and gets its own images."""
    pipeline = budgeted(budget_images, limit=2)
    requests = four_requests(pipeline)
    rows = 2 * sum(r.params.n for r in requests) * 2  # CFG: 2 rows per image, 2 steps
    key = pipeline.batch_key(requests[0])
    result = run_batch(pipeline, RequestBatch(key=key, requests=tuple(requests)))
    assert not result.errors and pipeline.denoised_rows == rows
    assert (pipeline.decode_out_of_memory() == 0) == (budget_images == 2)
    pipeline.denoised_rows = 0
    stepped = run_interleaved(pipeline, requests, [0, 0, 0])
    assert pipeline.denoised_rows == rows
    for request in requests:
        together = result.outputs[request.request_id]
        alone = run_batch(pipeline, RequestBatch(key=key, requests=(request,))).outputs[request.request_id]
        for mine, step, solo in zip(
            together.images, stepped[request.request_id].images, alone.images, strict=True
        ):
            assert difference(mine, solo) <= 1 and difference(step, solo) <= 1


@pytest.mark.slow
def test_a_budget_of_two_images_bounds_the_decode_of_eight_at_256() -> None:
    """Finishing 8 requests at 256² on tiny-sd with a decode budget of 2 images peaks well below
    one 8-image decode, with the same images. The issue's target (≤ 0.35x at 512²) is a
    benchmark figure (`python -m bench.decode_memory`: 0.27x); resident memory depends on the
    allocator's state (CI rehearsals read 0.42x at 512², runs here 0.17 to 0.40x at 256²), so the
    test guards against losing the bound (a whole-batch decode reads ~1x), not the figure. At
    256² the decode's activations still dwarf the model, at a quarter of 512²'s minute.
    Peak: the resident high-water mark over the finish (`bench.decode_memory`)."""
    from bench.decode_memory import measure

    result = measure("tiny-sd", 256, 8, 2, rounds=1)
    assert result["ratio"] <= 0.6, result
    assert result["max_difference_levels"] == 0, result
