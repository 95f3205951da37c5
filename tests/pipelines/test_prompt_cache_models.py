"""The prompt-embedding cache on the tiny models: images with it equal images without it,
at request level and step level, for requests that repeat prompts and negative prompts
(hits) beside new ones (misses), joining at different steps."""

from __future__ import annotations

import pytest
import torch

from engine.request import GenerationRequest, RequestBatch, RequestOutput, SamplingParams
from pipelines.adapter import DiffusersAdapter
from pipelines.base import PipelineConfig
from pipelines.registry import load_pipeline
from tests.pipelines.engines import difference
from tests.pipelines.test_stepping import run_interleaved
from tests.threads import THREADS

pytestmark = pytest.mark.slow

# Families whose encoders differ in kind: CLIP at a fixed length (sd), two encoders and
# zeroed negatives (sdxl), T5 + pooled + shared text ids (flux), padding to the longest text
# with a mask (qwen-image), captions of their own lengths (z-image), three encoders (sd3),
# a T5 mask (chroma), video (wan).
MODELS = [
    "tiny-sd",
    "tiny-sdxl",
    "tiny-flux",
    "tiny-qwen-image",
    "tiny-z-image",
    "tiny-sd3",
    "tiny-chroma",
    "tiny-wan",
]


def requests_for(pipeline: DiffusersAdapter) -> list[GenerationRequest]:
    """One prompt sent with several seeds, with and without a negative prompt, beside others."""
    shapes = [
        ("a red cat on the moon", None, 1, 1),
        ("a red cat on the moon", None, 1, 2),
        ("a painting", "ugly", 2, 3),
        ("a red cat on the moon", "ugly", 1, 4),
        ("a red cat on the moon", None, 2, 5),
        ("a painting", "ugly", 1, 6),
    ]
    requests = []
    for prompt, negative, n, seed in shapes:
        params = SamplingParams(
            num_inference_steps=4,
            guidance_scale=4.0,
            true_cfg_scale=2.0 if pipeline.default_true_cfg_scale is not None else None,
            num_frames=5 if pipeline.modality == "video" else None,
            negative_prompt=negative,
            n=n,
            seed=seed,
        )
        request = GenerationRequest.create(prompt, params)
        requests.append(request.with_params(pipeline.resolve(request)))
    return requests


def pair(model: str) -> tuple[DiffusersAdapter, DiffusersAdapter]:
    """The model without and with a prompt cache."""
    off, on = (
        load_pipeline(PipelineConfig(model=model, num_threads=THREADS, prompt_cache_mb=mb)) for mb in (0, 64)
    )
    assert isinstance(off, DiffusersAdapter) and isinstance(on, DiffusersAdapter)
    assert off.prompt_cache is None and on.prompt_cache is not None
    return off, on


def same_images(got: RequestOutput, reference: RequestOutput) -> None:
    assert got.seeds == reference.seeds
    for image, expected in zip(got.images, reference.images, strict=True):
        assert difference(image, expected) <= 1


@pytest.mark.parametrize("model", MODELS)
def test_images_with_the_prompt_cache_equal_images_without(model: str) -> None:
    off, on = pair(model)
    requests = requests_for(off)
    # Request level: each request alone, then all in one batch (a batch holds one n).
    for request in requests:
        (got,) = on.forward(RequestBatch(key=(), requests=(request,)))
        (reference,) = off.forward(RequestBatch(key=(), requests=(request,)))
        # Within 1/255, not equal: a cached text was encoded in another batch (n=2 encodes
        # its prompt once, not twice), which moves a float by ~1e-6, as batching does.
        same_images(got, reference)
    ones = tuple(r for r in requests if r.params.n == 1)
    for got, reference in zip(
        on.forward(RequestBatch(key=(), requests=ones)),
        off.forward(RequestBatch(key=(), requests=ones)),
        strict=True,
    ):
        same_images(got, reference)
    request_hits = on.prompt_cache_counts()
    assert request_hits is not None and request_hits["hits"] > 0
    # Step level: joining at different steps, so later joiners hit what earlier ones encoded.
    if not on.supports_step_batch:
        return
    joins = [0, 0, 1, 2, 2, 3]
    stepped_on, stepped_off = run_interleaved(on, requests, joins), run_interleaved(off, requests, joins)
    for request in requests:
        same_images(stepped_on[request.request_id], stepped_off[request.request_id])
    counts = on.prompt_cache_counts()
    assert counts is not None and counts["hits"] > request_hits["hits"]


# Every text-to-X family that steps: its step-level encode with the cache gives the
# conditioning it gives without (a cheap check, no denoising, of each encoder's outputs).
ENCODERS = [
    "tiny-sd",
    "tiny-sdxl",
    "tiny-flux",
    "tiny-qwen-image",
    "tiny-qwen-image-21",
    "tiny-sd3",
    "tiny-wan",
    "tiny-wan22",
    "tiny-ltx",
    "tiny-hunyuan-video15",
    "tiny-z-image",
    "tiny-chroma",
    "tiny-ovis-image",
    "tiny-flux2-klein",
    "shapes-dit",
]


@pytest.mark.parametrize("model", ENCODERS)
def test_step_level_conditioning_with_the_prompt_cache_equals_it_without(model: str) -> None:
    off, on = pair(model)
    requests = requests_for(off)
    with torch.inference_mode():
        reference = off.family.encode(requests, off.task)
        on.family.encode(requests[:3], on.task)  # some texts cached, in calls of their own
        got = on.family.encode(requests, on.task)
        again = on.family.encode(requests, on.task)  # every text a hit
    counts = on.prompt_cache_counts()
    assert counts is not None and counts["hits"] > 0
    for encoded in (got, again):
        for (cond, uncond), (expected, expected_uncond) in zip(encoded, reference, strict=True):
            for mine, theirs in ((cond, expected), (uncond, expected_uncond)):
                assert (mine is None) == (theirs is None)
                if mine is None or theirs is None:
                    continue
                assert mine.keys() == theirs.keys()
                for name, value in mine.items():
                    if isinstance(value, torch.Tensor):
                        torch.testing.assert_close(value, theirs[name], atol=1e-4, rtol=1e-4, msg=name)


# Served request-level only: the generic adapter's pipelines (their own `encode_prompt`s)
# and LTX-2 (video and audio).
REQUEST_LEVEL = ["tiny-pixart-sigma", "tiny-sana", "tiny-ltx2"]


@pytest.mark.parametrize("model", REQUEST_LEVEL)
def test_request_level_images_with_the_prompt_cache_equal_images_without(model: str) -> None:
    off, on = pair(model)
    first, again = requests_for(off)[:2]  # one prompt, two seeds: the second a hit
    for request in (first, again):
        (got,) = on.forward(RequestBatch(key=(), requests=(request,)))
        (reference,) = off.forward(RequestBatch(key=(), requests=(request,)))
        same_images(got, reference)
    counts = on.prompt_cache_counts()
    assert counts is not None and counts["hits"] > 0
