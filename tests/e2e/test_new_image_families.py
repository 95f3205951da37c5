"""The image families of issue 24 behind a real `diffbatch serve MODEL` (step-level, the
default), driven by the official `openai` client: requests with different steps, guidance,
negative prompts and n sent together share denoiser forwards, and each gets the image
diffusers' own pipeline call makes for it alone. One server per family, a few requests each."""

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

# Each family's tiny model, and a guidance scale that guides it (its diffusers threshold).
MODELS = {
    "tiny-z-image": 3.0,  # guides above 0; Turbo's 0 is the unguided request below
    "tiny-chroma": 3.0,  # guides above 1
    "tiny-ovis-image": 3.0,  # guides above 1
}


@pytest.fixture(scope="module", params=list(MODELS))
def family_server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Server]]:
    """(tiny model, its server)."""
    model: str = request.param
    server = start_server(tmp_path_factory.mktemp("family"), model, "--num-threads", "1", config=None)
    yield model, server
    stop_server(server)


def bodies(model: str) -> list[dict[str, Any]]:
    return [
        {
            "prompt": "a red cat",
            "n": 2,
            "extra_body": {"seed": 1, "num_inference_steps": 3, "guidance_scale": 0.0},
        },
        {
            "prompt": "an astronaut riding a horse on the moon",
            "n": 1,
            "extra_body": {
                "seed": 2,
                "num_inference_steps": 5,
                "guidance_scale": MODELS[model],
                "negative_prompt": "blurry",
            },
        },
    ]


def test_requests_share_steps_and_each_matches_the_stock_pipeline_alone(
    family_server: tuple[str, Server],
) -> None:
    model, server = family_server
    sent = bodies(model)

    def send() -> list[Any]:
        with client_for(server) as client, ThreadPoolExecutor(len(sent)) as pool:
            return list(pool.map(lambda body: client.images.generate(size="64x64", **body), sent))

    results = sent_together(server, send)
    assert "step-level batching" in server.log.read_text()
    references = []

    pipeline = load_pipeline(PipelineConfig(model=model, num_threads=1))
    assert isinstance(pipeline, DiffusersAdapter)
    for body, result in zip(sent, results, strict=True):
        served = [pixels(d.b64_json) for d in result.data or []]
        params = SamplingParams(width=64, height=64, n=body["n"], **body["extra_body"])
        request = GenerationRequest.create(body["prompt"], params)
        alone = stock_output(pipeline, request.with_params(pipeline.resolve(request)))
        assert len(served) == body["n"]
        for image, reference in zip(served, alone.images, strict=True):
            assert np.abs(image.astype(int) - reference.astype(int)).max() <= 1
        references.append((served[0].astype(int), alone.images[0].astype(int)))
    # The comparison can fail: the two requests' images are far apart.
    (first, first_alone), (second, second_alone) = references
    assert np.abs(first - second_alone).max() > 8 and np.abs(second - first_alone).max() > 8
