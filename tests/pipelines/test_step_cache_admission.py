"""Which families take First-Block Cache in which batching mode: step mode's per-request
cache takes every DiT family it has block layouts for (`pipelines.cache.block_args`);
request mode runs diffusers' own hooks on the whole batch, and is refused at admission
(a 400 naming cache.mode) where those hooks fail on the family's transformer. And the
families whose steps call their denoiser otherwise keep residuals per kind of forward."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from diffusers.hooks import FirstBlockCacheConfig

from engine.request import CacheChoice, GenerationRequest, InvalidRequestError, RequestBatch, SamplingParams
from pipelines.adapter import DiffusersAdapter
from pipelines.base import PipelineConfig
from pipelines.denoiser.options import DenoiserConfig
from pipelines.registry import load_pipeline
from pipelines.stepping.experts import HIGH_NOISE, LOW_NOISE
from tests.pipelines.engines import difference
from tests.pipelines.test_step_cache import requests_of
from tests.pipelines.test_stepping import loaded
from tests.threads import THREADS

# Step mode caches them; diffusers 0.42.1's hooks fail on their transformers in request mode
# (blocks its registry lacks, FLUX.2's joined single-block stream, Z-Image's lists of rows),
# or would cache one expert of two (Wan 2.2).
REQUEST_MODE_REFUSED = [
    "tiny-flux2",
    "tiny-flux2-klein",
    "tiny-z-image",
    "tiny-qwen-image-21",
    "tiny-hunyuan-video15",
    "tiny-ltx2",
    "tiny-chroma",
    "tiny-ovis-image",
    "tiny-wan22",
]
DIFFUSERS_FAILS = [model for model in REQUEST_MODE_REFUSED if model != "tiny-wan22"]


def request_level(model: str) -> DiffusersAdapter:
    # `THREADS`, as `loaded`: loading sets torch's threads for the whole process, and tests
    # after these compare images bit for bit with pipelines loaded that way.
    config = PipelineConfig(
        model=model, num_threads=THREADS, denoiser=DenoiserConfig(warmup_batching="request")
    )
    pipeline = load_pipeline(config)
    assert isinstance(pipeline, DiffusersAdapter)
    return pipeline


def request(pipeline: DiffusersAdapter, cache: CacheChoice | None) -> GenerationRequest:
    frames = 9 if pipeline.modality == "video" else None
    params = SamplingParams(num_inference_steps=4, seed=1, num_frames=frames, cache=cache)
    plain = GenerationRequest.create("a red circle", params)
    return plain.with_params(pipeline.resolve(plain))


@pytest.mark.parametrize("model", REQUEST_MODE_REFUSED)
def test_step_mode_takes_the_cache_where_request_mode_refuses_it(model: str) -> None:
    assert loaded(model).cache_refusal("first-block") is None
    pipeline = request_level(model)
    assert pipeline.cache_refusal("first-block") is not None
    with pytest.raises(InvalidRequestError) as refused:
        pipeline.validate(request(pipeline, CacheChoice("first-block", 0.1)).params)
    assert refused.value.param == "cache.mode"
    pipeline.validate(request(pipeline, CacheChoice("none")).params)


@pytest.mark.parametrize("model", DIFFUSERS_FAILS)
def test_diffusers_hooks_fail_on_the_refused_transformers(model: str) -> None:
    """Why request mode is refused there: the stock call under diffusers' own hooks raises
    (when a diffusers release fixes one, this fails and the refusal can go)."""
    pipeline = request_level(model)
    transformer = pipeline.pipe.transformer
    with pytest.raises((TypeError, ValueError, AttributeError)):
        transformer.enable_cache(FirstBlockCacheConfig(threshold=0.3))
        with transformer.cache_context("batch"):
            pipeline.forward(RequestBatch(key=(), requests=(request(pipeline, None),)))
    if getattr(transformer, "is_cache_enabled", False):
        transformer.disable_cache()


@pytest.mark.parametrize(
    "choice",
    [CacheChoice("first-block", 0.3), CacheChoice("taylorseer", interval=2, warmup=1)],
    ids=lambda c: c.mode,
)
def test_ltx_request_mode_runs_diffusers_hooks_over_the_batch(choice: CacheChoice) -> None:
    pipeline = request_level("tiny-ltx")
    assert pipeline.cache_refusal(choice.mode) is None
    cached_request = request(pipeline, choice)
    (cached,) = pipeline.forward(RequestBatch(key=(), requests=(cached_request,)))
    plain = cached_request.with_params(replace(cached_request.params, cache=None))
    (uncached,) = pipeline.forward(RequestBatch(key=(), requests=(plain,)))
    assert difference(cached.images[0], uncached.images[0]) > 0


def test_wan_vace_refuses_the_cache_in_step_mode_with_one_expert_or_two() -> None:
    vace = loaded("tiny-wan-vace")
    assert vace.family.two_experts()
    assert vace.cache_refusal("first-block") is not None


def stepped_once(model: str, requests: int = 2) -> list[Any]:
    pipeline = loaded(model)
    choices: list[CacheChoice | None] = [CacheChoice("first-block", 0.5)] * requests
    states = pipeline.prepare(requests_of(pipeline, choices, [6] * requests))
    pipeline.step(states)
    return states


def test_each_of_ltx2s_passes_keeps_its_own_residuals() -> None:
    (state,) = stepped_once("tiny-ltx2", 1)
    assert {kind for _phase, kind, _tokens in state.cache.residuals} == {"main", "perturbed", "isolated"}


def test_qwen_image_21_keeps_residuals_per_text_length() -> None:
    """The request with a negative prompt (`requests_of`'s second) has rows of two lengths."""
    _, guided = stepped_once("tiny-qwen-image-21")
    lengths = {tokens for _phase, _kind, tokens in guided.cache.residuals}
    assert len(lengths) == 2 and None not in lengths


def test_wan_22_starts_a_requests_residuals_again_with_its_second_expert() -> None:
    pipeline = loaded("tiny-wan22")
    (request,) = requests_of(pipeline, [CacheChoice("first-block", 0.5)], [8])
    (state,) = pipeline.prepare([request])
    phases = []
    while not state.is_done:
        pipeline.step([state])
        phases.append({phase for phase, _kind, _tokens in state.cache.residuals})
    assert phases[0] == {HIGH_NOISE} and phases[-1] == {LOW_NOISE}


def test_qwen_image_edit_2511_takes_only_taylorseer_and_only_in_step_mode() -> None:
    """Its `zero_cond_t` doubles the timestep rows inside the forward, which First-Block
    Cache's per-row cut does not follow; TaylorSeer needs nothing of the denoiser."""
    stepped = loaded("tiny-qwen-image-edit-2511")
    assert stepped.cache_refusal("first-block") is not None
    assert stepped.cache_refusal("taylorseer") is None
    whole_batch = request_level("tiny-qwen-image-edit-2511")
    assert whole_batch.cache_refusal("first-block") is not None
    assert whole_batch.cache_refusal("taylorseer") is not None


def test_wan_22_ti2v_has_one_transformer_and_takes_the_hooks_in_request_mode() -> None:
    pipeline = request_level("tiny-wan22-ti2v")
    assert not pipeline.family.two_experts()
    assert pipeline.cache_refusal("first-block") is None
    assert pipeline.cache_refusal("taylorseer") is None
