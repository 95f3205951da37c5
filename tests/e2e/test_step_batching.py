"""A real `diffbatch serve --batching step` driven by the official `openai` client: requests
with different steps, guidance, negative prompts and n share denoising steps, and each
gets the image diffusers' own pipeline call makes for it alone."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

from engine.request import GenerationRequest, SamplingParams
from pipelines.adapter import DiffusersAdapter
from pipelines.base import PipelineConfig
from pipelines.registry import load_pipeline
from tests.e2e.conftest import Server, start_server, stop_server
from tests.e2e.sharing import sent_together
from tests.e2e.test_openai_client import client_for, pixels
from tests.pipelines.stock import stock_output

pytestmark = pytest.mark.slow

REQUESTS: list[dict[str, Any]] = [
    {
        "prompt": "a red cat",
        "n": 1,
        "extra_body": {"seed": 1, "num_inference_steps": 6, "guidance_scale": 7.5},
    },
    {
        "prompt": "a house on a hill",
        "n": 2,
        "extra_body": {"seed": 2, "num_inference_steps": 3, "guidance_scale": 1.0},
    },
    {
        "prompt": "an astronaut riding a horse on the moon",
        "n": 1,
        "extra_body": {
            "seed": 3,
            "num_inference_steps": 9,
            "guidance_scale": 4.0,
            "negative_prompt": "blurry",
        },
    },
    {
        "prompt": "a bowl of fruit",
        "n": 1,
        "extra_body": {"seed": 4, "num_inference_steps": 4, "guidance_scale": 3.0},
    },
]


@pytest.fixture(scope="module")
def step_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # VAE previews, so that a test can see them converge (the linear default is a coarse map).
    # In a worker process: mixed requests' states are held there between steps, and their
    # images and previews come back through shared memory (the thread executor shares the
    # stepping code, and the package's `server` runs in a thread).
    server = start_server(
        tmp_path_factory.mktemp("step"),
        "--batching",
        "step",
        "--num-threads",
        "1",
        "--preview-decoder",
        "vae",
        "--executor",
        "process",
    )
    yield server
    stop_server(server)


def test_mixed_requests_share_steps_and_match_their_solo_images(step_server: Server) -> None:
    def send() -> list[Any]:
        with client_for(step_server) as client, ThreadPoolExecutor(len(REQUESTS)) as pool:
            return list(pool.map(lambda body: client.images.generate(size="64x64", **body), REQUESTS))

    results = sent_together(step_server, send)
    served = [[pixels(d.b64_json) for d in r.data or []] for r in results]
    references = []

    sd = load_pipeline(PipelineConfig(model="tiny-sd", num_threads=1))
    assert isinstance(sd, DiffusersAdapter)
    for body, images in zip(REQUESTS, served, strict=True):
        extra = body["extra_body"]
        params = SamplingParams(
            width=64,
            height=64,
            n=body["n"],
            seed=extra["seed"],
            num_inference_steps=extra["num_inference_steps"],
            guidance_scale=extra["guidance_scale"],
            negative_prompt=extra.get("negative_prompt"),
        )
        request = GenerationRequest.create(body["prompt"], params)
        alone = stock_output(sd, request.with_params(sd.resolve(request)))
        assert len(images) == body["n"]
        for image, reference in zip(images, alone.images, strict=True):
            assert np.abs(image.astype(int) - reference.astype(int)).max() <= 1
        references.append(alone.images[0].astype(int))
    # The comparison can fail: each request's image is far from every other request's.
    for i, images in enumerate(served):
        others = [ref for j, ref in enumerate(references) if j != i]
        assert all(np.abs(images[0].astype(int) - other).max() > 8 for other in others)


def test_the_server_says_it_steps_and_counts_denoiser_forwards_and_decodes(step_server: Server) -> None:
    decodes_before = step_server.metric("diffbatch_decode_batch_size_count")
    with client_for(step_server) as client:
        client.images.generate(prompt="a cat", size="64x64", extra_body={"num_inference_steps": 3})
    assert "step-level batching" in step_server.log.read_text()
    # One denoiser forward per step: the batch-size histogram counts steps in this mode.
    assert step_server.metric("diffbatch_batch_size_count") >= 3
    # Its VAE decode, alone: one decode of one request.
    assert step_server.metric("diffbatch_decode_batch_size_count") - decodes_before == 1
    assert step_server.metric('diffbatch_decode_batch_size_bucket{le="1.0"}') >= 1


def test_partial_images_stream_with_the_official_client(step_server: Server) -> None:
    with client_for(step_server) as client:
        stream = client.images.generate(
            prompt="a red cat",
            size="64x64",
            stream=True,
            partial_images=2,
            extra_body={"seed": 7, "num_inference_steps": 6},
        )
        events = list(stream)
        plain = client.images.generate(
            prompt="a red cat", size="64x64", extra_body={"seed": 7, "num_inference_steps": 6}
        )
    assert [e.type for e in events] == ["image_generation.partial_image"] * 2 + ["image_generation.completed"]
    partials, completed = events[:2], events[2]
    assert [e.partial_image_index for e in partials] == [0, 1]  # type: ignore[union-attr]
    assert all(pixels(e.b64_json).shape == (64, 64, 3) and e.size == "64x64" for e in events)
    final = pixels(completed.b64_json)
    # Previews change nothing, and each is an estimate of the final image, the later the closer.
    assert (final == pixels((plain.data or [])[0].b64_json)).all()
    errors = [np.abs(pixels(e.b64_json).astype(float) - final).mean() for e in partials]
    assert errors[1] < errors[0]


def test_quality_picks_the_step_count_and_is_reported(step_server: Server) -> None:
    """tiny-sd serves 8 steps by default: quality low is 2 (one denoiser step each, in this
    mode), high is the default; explicit steps win over quality."""

    def steps_taken(**body: Any) -> tuple[float, Any]:
        before = step_server.metric("diffbatch_batch_size_count")
        with client_for(step_server) as client:
            result = client.images.generate(prompt="a cat", size="64x64", **body)
        return step_server.metric("diffbatch_batch_size_count") - before, result

    low, result = steps_taken(quality="low")
    assert low == 2 and result.quality == "low"
    high, result = steps_taken(quality="high")
    assert high == 8 and result.quality == "high"
    explicit, result = steps_taken(quality="low", extra_body={"num_inference_steps": 3})
    assert explicit == 3 and result.quality is None
