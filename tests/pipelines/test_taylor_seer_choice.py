"""A request's TaylorSeer choice beyond step mode's groups (issue 27): its fields and their
400s, request-level batching (diffusers' own hooks over the whole batch, refused where they
cannot go), step mode alone against diffusers' hook, and a worker process's `spec()`
answering admission as its pipeline does. Every pipeline here loads with `THREADS` threads, as
`tests.pipelines.test_stepping.loaded` does (loading sets torch's threads for the process)."""

from __future__ import annotations

import pickle
from dataclasses import replace
from typing import Any

import pytest

from engine.request import CacheChoice, GenerationRequest, InvalidRequestError, RequestBatch, SamplingParams
from pipelines.adapter import DiffusersAdapter
from pipelines.base import PipelineConfig
from pipelines.cache.taylor_seer import whole_batch_config
from pipelines.denoiser.options import DenoiserConfig
from pipelines.registry import load_pipeline
from tests.pipelines.engines import difference
from tests.pipelines.test_step_cache import requests_of
from tests.pipelines.test_step_taylor_seer import alone, seer
from tests.pipelines.test_stepping import loaded
from tests.threads import THREADS


@pytest.mark.slow
def test_request_mode_runs_diffusers_hooks_over_the_batch() -> None:
    """A request-level forward with TaylorSeer is diffusers' pipeline with its own TaylorSeer
    on (lite mode), and the hooks are gone after the call."""
    pipeline = loaded("shapes-dit")
    choice = seer(3, 2, 1)
    (request,) = requests_of(pipeline, [choice], [10])
    (cached,) = pipeline.forward(RequestBatch(key=(), requests=(request,)))
    assert not pipeline.pipe.transformer.is_cache_enabled
    pipeline.pipe.transformer.enable_cache(whole_batch_config(choice))
    try:
        plain = request.with_params(replace(request.params, cache=None))
        (stock,) = pipeline.forward(RequestBatch(key=(), requests=(plain,)))
    finally:
        pipeline.pipe.transformer.disable_cache()
    (uncached,) = pipeline.forward(RequestBatch(key=(), requests=(plain,)))
    assert difference(cached.images[0], stock.images[0]) == 0
    assert difference(cached.images[0], uncached.images[0]) > 0
    assert pipeline.batch_key(request) != pipeline.batch_key(plain)


@pytest.mark.slow
def test_a_unet_takes_it_in_step_mode_and_refuses_it_by_field_request_level() -> None:
    """Stable Diffusion's UNet has no diffusers cache hooks to put on a request-level batch:
    there a request choosing TaylorSeer is a 400 naming `cache.mode`, and a server default
    stops start-up; in step mode, which predicts each request's output itself, it is taken."""
    request = GenerationRequest.create("x", SamplingParams(cache=seer(2, 1, 1)))
    sd = loaded("tiny-sd")
    sd.validate(sd.resolve(request))
    request_level = PipelineConfig(
        # `THREADS` threads, as every pipeline of this file: loading sets torch's thread count for the
        # process, and the exact comparisons after it are of one count.
        model="tiny-sd",
        num_threads=THREADS,
        denoiser=DenoiserConfig(warmup_batching="request"),
    )
    whole_batch = load_pipeline(request_level)
    with pytest.raises(InvalidRequestError, match="taylorseer") as refused:
        whole_batch.validate(whole_batch.resolve(request))
    assert refused.value.param == "cache.mode"
    with pytest.raises(ValueError, match="cache"):
        load_pipeline(replace(request_level, cache=seer(2, 1, 1)))


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"mode": "taylorseer", "threshold": 0.1}, "cache.threshold"),
        ({"mode": "taylorseer", "interval": 0}, "cache.interval"),
        ({"mode": "taylorseer", "interval": 2.5}, "cache.interval"),
        ({"mode": "taylorseer", "warmup": -1}, "cache.warmup"),
        ({"mode": "taylorseer", "order": 5}, "cache.order"),
        ({"mode": "first-block", "threshold": 0.1, "interval": 2}, "cache.interval"),
        ({"mode": "none", "order": 2}, "cache.order"),
    ],
)
def test_a_bad_choice_names_its_field(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequestError) as refused:
        CacheChoice(**fields)
    assert refused.value.param == param


def test_an_interval_of_one_is_no_cache() -> None:
    assert not seer(1, 3, 1).on
    assert seer(2, 3, 1).on


@pytest.mark.slow
def test_step_mode_alone_is_diffusers_taylor_seer() -> None:
    """One request alone in step mode makes the image diffusers' own TaylorSeer (lite mode)
    makes in a request-level call: the same schedule and the same series."""
    pipeline = loaded("shapes-dit")
    for choice in (seer(3, 2, 1), seer(2, 1, 2)):
        (request,) = requests_of(pipeline, [choice], [10])
        stepped, series = alone(pipeline, request)
        (called,) = pipeline.forward(RequestBatch(key=(), requests=(request,)))
        assert series.steps_skipped > 0
        # Within 1/255: the two paths' forwards are the same rows in different calls, and with
        # one torch thread (set by any earlier load with num_threads=1) one pixel rounds apart.
        assert difference(stepped.images[0], called.images[0]) <= 1


@pytest.mark.slow
@pytest.mark.parametrize(
    "choice", [seer(3, 2, 1), CacheChoice("first-block", 0.5)], ids=["taylorseer", "first-block"]
)
def test_request_level_batching_refuses_a_cache_where_diffusers_hooks_cannot_go(choice: CacheChoice) -> None:
    """SD3's transformer has no `enable_cache` (diffusers' `CacheMixin`, 0.42.1), and the
    hooks put on by hand fail on its last block (it returns no text stream): served
    request-level, a request choosing a cache is a 400 naming `cache.mode` and a server
    default one stops start-up, where it used to fail inside the forward. Step mode, which
    caches per request with its own code, takes it."""
    request_level = PipelineConfig(
        model="tiny-sd3", num_threads=THREADS, denoiser=DenoiserConfig(warmup_batching="request")
    )
    pipeline = load_pipeline(request_level)
    assert isinstance(pipeline, DiffusersAdapter)
    assert not hasattr(pipeline.pipe.transformer, "enable_cache")
    (request,) = requests_of(loaded("tiny-sd3"), [choice], [8])
    with pytest.raises(InvalidRequestError) as refused:
        pipeline.validate(request.params)
    assert refused.value.param == "cache.mode"
    loaded("tiny-sd3").validate(request.params)  # step mode
    with pytest.raises(ValueError, match="request-level batching"):
        load_pipeline(replace(request_level, cache=choice))


@pytest.mark.slow
@pytest.mark.parametrize("batching", ["request", "step"])
def test_a_worker_process_s_spec_answers_admission_as_its_pipeline(batching: str) -> None:
    """With `--executor process` the front process admits requests with the worker's `spec()`
    (its pipeline without weights, pickled across): it refuses and takes each cache mode as
    the loaded pipeline does, though it holds no denoiser to ask whether diffusers' hooks fit
    (FLUX's fit request-level, Stable Diffusion's UNet has none)."""
    denoiser = DenoiserConfig(warmup_batching=batching)  # type: ignore[arg-type]
    for model in ("tiny-flux", "tiny-sd"):
        pipeline = load_pipeline(PipelineConfig(model=model, num_threads=THREADS, denoiser=denoiser))
        assert isinstance(pipeline, DiffusersAdapter)
        spec = pickle.loads(pickle.dumps(pipeline.spec()))
        for mode in ("taylorseer", "first-block"):
            assert spec.cache_refusal(mode) == pipeline.cache_refusal(mode), (model, mode)
        takes = pipeline.cache_refusal("taylorseer") is None
        assert takes == (batching == "step" or model == "tiny-flux"), model
