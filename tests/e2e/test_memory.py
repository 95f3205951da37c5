"""A real `diffbatch serve` with its weights offloaded to disk block by block (`--offload
group --offload-to-disk`, the offload that runs on a CPU) and a decode budget of one image,
driven by the official client in both batching modes: each request gets the image the
plain model makes for it alone."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest

from engine.request import GenerationRequest, RequestBatch, SamplingParams
from pipelines.base import PipelineConfig
from pipelines.registry import load_pipeline
from tests.e2e.conftest import Server, start_server, stop_server
from tests.e2e.test_openai_client import client_for, pixels
from tests.pipelines.engines import difference

pytestmark = pytest.mark.slow

REQUESTS = [("a red cat", 1, 1), ("a house on a hill", 2, 2), ("the moon", 3, 1)]


@pytest.fixture(scope="module", params=["step", "request"])
def offloaded(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    workdir = tmp_path_factory.mktemp("offload")
    server = start_server(
        workdir,
        "--batching",
        request.param,
        "--request-batch-max-wait-ms",
        "2000",
        "--offload",
        "group",
        "--offload-to-disk",
        str(workdir / "blocks"),
        "--decode-budget",
        "1x64x64",
    )
    yield server
    stop_server(server)


def test_offloaded_to_disk_each_request_gets_its_image_alone(offloaded: Server) -> None:
    def generate(item: tuple[str, int, int]) -> list[np.ndarray]:
        prompt, seed, n = item
        with client_for(offloaded) as client:
            result = client.images.generate(
                prompt=prompt, n=n, size="64x64", extra_body={"seed": seed, "num_inference_steps": 3}
            )
        return [pixels(d.b64_json) for d in result.data or []]

    with ThreadPoolExecutor(len(REQUESTS)) as pool:
        served = list(pool.map(generate, REQUESTS))
    plain = load_pipeline(PipelineConfig(model="tiny-sd", num_threads=1))
    for (prompt, seed, n), images in zip(REQUESTS, served, strict=True):
        params = SamplingParams(width=64, height=64, n=n, seed=seed, num_inference_steps=3)
        request = GenerationRequest.create(prompt, params)
        request = request.with_params(plain.resolve(request))
        (alone,) = plain.forward(RequestBatch(key=(), requests=(request,)))
        assert len(images) == n
        for image, reference in zip(images, alone.images, strict=True):
            assert difference(image, reference) <= 1
    assert any(Path(offloaded.log.parent / "blocks").rglob("*.safetensors"))


@pytest.mark.parametrize(
    ("flags", "state", "reason"),
    [
        ((), "skipped", "--profile-run auto profiles on an accelerator only; cpu is not one"),
        (("--profile-run", "on"), "unmeasured", "cpu has no memory gauge"),
    ],
)
def test_health_and_metrics_say_what_the_profile_run_at_start_did_on_the_cpu(
    tmp_path: Path, flags: tuple[str, ...], state: str, reason: str
) -> None:
    """The CPU has no device memory to read: `auto` skips the run, `on` makes it (a step
    group and a decode on dummy requests) and says nothing was measured or lowered."""
    server = start_server(tmp_path, "--batching", "step", "--max-num-seqs", "2", *flags)
    try:
        health = httpx.get(f"{server.url}/health").json()
        assert health["status"] == "ok"
        profile = health["profile_run"]
        assert profile["state"] == state and reason in profile["reason"], profile
        assert profile["max_num_seqs"] is None and profile["step_peak"] is None
        assert server.metric(f'diffbatch_profile_run{{state="{state}"}}') == 1
        assert server.metric('diffbatch_profile_run{state="measured"}') == 0
        with client_for(server) as client:  # and it serves
            assert len(client.images.generate(prompt="a cat", size="64x64").data or []) == 1
    finally:
        stop_server(server)
