"""A real `diffbatch serve` with each `--quantization` choice that runs on a CPU: it starts
(its weights are counted for residency, quantized tensors included) and serves an image to
the official client. The choices come from `pipelines.memory.options`, so a new one is
started here as soon as it exists. The servers start together (their loads overlap)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from bench.launch import spawn_server, wait_until_ready
from pipelines.memory.options import NEEDS_CUDA, PACKAGES, SCHEMES, installed
from tests.e2e.conftest import Server, stop_server
from tests.e2e.test_openai_client import client_for, pixels

pytestmark = pytest.mark.slow

ON_CPU = [
    f"{backend}:{scheme}"
    for backend, schemes in SCHEMES.items()
    for scheme in schemes
    if (backend, scheme) not in NEEDS_CUDA
]


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Server]]:
    for choice in ON_CPU:  # the test extra installs every CPU backend's package
        package = PACKAGES[choice.split(":")[0]]
        assert package is None or installed(package), f"{choice} needs {package}"
    started: dict[str, Server] = {}
    try:
        for choice in ON_CPU:
            workdir = tmp_path_factory.mktemp(choice.replace(":", "-"))
            started[choice] = spawn_server(workdir, "--quantization", choice, "--num-threads", "1")
        for server in started.values():
            wait_until_ready(server)
        yield started
    finally:
        for server in started.values():
            if server.process.poll() is None:
                stop_server(server)


def test_the_cpu_choices_are_the_expected_ones() -> None:
    assert ON_CPU == ["torchao:int8wo", "layerwise:float8_e4m3fn", "layerwise:float8_e5m2"]


@pytest.mark.parametrize("choice", ON_CPU)
def test_a_server_with_quantized_weights_starts_and_serves(servers: dict[str, Server], choice: str) -> None:
    server = servers[choice]
    assert httpx.get(f"{server.url}/health").json()["status"] == "ok"
    with client_for(server) as client:
        result = client.images.generate(
            prompt="a red cat", size="64x64", extra_body={"seed": 1, "num_inference_steps": 2}
        )
    (image,) = result.data or []
    assert pixels(image.b64_json).shape == (64, 64, 3)
