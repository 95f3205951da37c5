"""Requests of three sizes at once to a real `diffbatch serve tiny-flux`, with the official
`openai` client: FLUX steps rows of different sizes in one denoiser forward, packed end to
end (issue 42), so they share forwards (the server's own `diffbatch_step_sizes` says a
forward carried several sizes), and each image equals diffusers' own pipeline call for it
alone."""

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
from tests.e2e.sharing import mixed_size_forwards, sent_together
from tests.e2e.test_openai_client import client_for, pixels
from tests.pipelines.stock import stock_output
from tests.threads import THREADS

pytestmark = pytest.mark.slow

# (size, steps, guidance): a step group of three sizes, each with its own steps and guidance.
SENT = [("32x32", 6, 3.5), ("48x48", 4, 5.0), ("64x64", 5, 1.0)]


@pytest.fixture(scope="module")
def flux_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(
        tmp_path_factory.mktemp("mixed"), "tiny-flux", "--num-threads", str(THREADS), config=None
    )
    yield server
    stop_server(server)


def test_three_sizes_share_forwards_and_each_equals_its_image_alone(flux_server: Server) -> None:
    def send() -> list[Any]:
        with client_for(flux_server) as client, ThreadPoolExecutor(len(SENT)) as pool:
            return list(
                pool.map(
                    lambda sent: client.images.generate(
                        model="tiny-flux",
                        prompt=f"a cat {sent[0]}",
                        size=sent[0],
                        extra_body={"seed": 5, "num_inference_steps": sent[1], "guidance_scale": sent[2]},
                    ),
                    SENT,
                )
            )

    # Fails unless a forward carried requests of different sizes (`diffbatch_step_sizes`).
    results = sent_together(flux_server, send, mixed_size_forwards)
    flux = load_pipeline(PipelineConfig(model="tiny-flux", num_threads=THREADS))
    assert isinstance(flux, DiffusersAdapter)
    for (size, steps, guidance), result in zip(SENT, results, strict=True):
        (data,) = result.data or []
        image = pixels(data.b64_json)
        side = int(size.split("x")[0])
        params = SamplingParams(
            width=side, height=side, seed=5, num_inference_steps=steps, guidance_scale=guidance
        )
        request = GenerationRequest.create(f"a cat {size}", params)
        (alone,) = stock_output(flux, request.with_params(flux.resolve(request))).images
        assert image.shape == alone.shape == (side, side, 3)
        assert np.abs(image.astype(int) - alone.astype(int)).max() <= 1, size
