"""LoRA adapters on a real `diffbatch serve`, with the official client: `/v1/models` lists
them, requests with different adapters (and none) sent together each get their solo
image in forwards of their own (`/metrics`), `--max-loras 1` with alternating adapters
in step-level batching gives the same images, and a bad adapter stops the start."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from tests.doc_pages import run_command_line
from tests.e2e.conftest import Server, start_server, stop_server
from tests.e2e.test_readme import curl_commands, is_lora

pytestmark = pytest.mark.slow

ADAPTERS = ["--lora-modules", "ghibli=tiny-lora-1", "pixel=tiny-lora-2"]
# (model, lora scale) per request: the base, both adapters, one of them twice and at half.
CHOICES = [("tiny-sd", None), ("ghibli", None), ("pixel", None), ("ghibli", None), ("pixel", 0.5)]


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(
        tmp_path_factory.mktemp("lora"),
        *ADAPTERS,
        "--batching",
        "request",
        "--request-batch-max-wait-ms",
        "2000",
    )
    yield server
    stop_server(server)


def body(model: str, scale: float | None, seed: int) -> dict[str, object]:
    fields: dict[str, object] = {
        "prompt": "a lighthouse",
        "model": model,
        "seed": seed,
        "num_inference_steps": 2,
    }
    if scale is not None:
        fields["lora"] = {"name": model, "scale": scale}
    return fields


def pixels(response: httpx.Response) -> np.ndarray:
    assert response.status_code == 200, response.text
    data = base64.b64decode(response.json()["data"][0]["b64_json"])
    return np.asarray(Image.open(io.BytesIO(data))).astype(np.int16)


async def send_together(server: Server, bodies: list[dict[str, object]]) -> list[np.ndarray]:
    async with httpx.AsyncClient(base_url=server.v1, timeout=120) as client:
        responses = await asyncio.gather(*(client.post("/images/generations", json=b) for b in bodies))
    return [pixels(response) for response in responses]


def test_models_lists_the_adapters_under_their_base(lora_server: Server) -> None:
    with openai.OpenAI(base_url=lora_server.v1, api_key="unused", max_retries=0) as client:
        cards = {card.id: card.model_extra or {} for card in client.models.list()}
        assert list(cards) == ["tiny-sd", "ghibli", "pixel"]
        assert cards["ghibli"]["parent"] == cards["pixel"]["parent"] == "tiny-sd"
        with pytest.raises(openai.NotFoundError, match="anime"):
            client.images.generate(model="anime", prompt="a lighthouse")


BODIES = [body(model, scale, seed) for seed, (model, scale) in enumerate(CHOICES)]


@pytest.fixture(scope="module")
def together(lora_server: Server) -> tuple[list[np.ndarray], dict[str, float]]:
    """The images of BODIES sent at once, and the forwards each adapter took for them."""
    before = {name: _forwards(lora_server, name) for name in ("none", "ghibli", "pixel")}
    images = asyncio.run(send_together(lora_server, BODIES))
    return images, {name: _forwards(lora_server, name) - count for name, count in before.items()}


def test_adapters_sent_together_each_get_their_solo_image_in_forwards_of_their_own(
    lora_server: Server, together: tuple[list[np.ndarray], dict[str, float]]
) -> None:
    images, forwards = together
    # The base in one forward, pixel at two scales in two; ghibli's two requests share one
    # when they arrive within the admission window (two on a machine too busy for that).
    assert forwards["none"] == 1 and forwards["pixel"] == 2 and forwards["ghibli"] in (1, 2)
    for sent, image in zip(BODIES, images, strict=True):
        alone = asyncio.run(send_together(lora_server, [sent]))[0]
        assert np.abs(image - alone).max() <= 1
    # Each adapter changes the image: the same seed without it, or with the other adapter.
    assert np.abs(images[1] - body_image(lora_server, "tiny-sd", 1)).max() > 10
    assert np.abs(images[2] - body_image(lora_server, "ghibli", 2)).max() > 10
    assert np.abs(images[0] - body_image(lora_server, "pixel", 0)).max() > 10


def test_one_loaded_adapter_at_a_time_in_step_batching_gives_the_same_images(
    together: tuple[list[np.ndarray], dict[str, float]], tmp_path: Path
) -> None:
    expected = together[0]
    one = start_server(tmp_path, *ADAPTERS, "--max-loras", "1", "--batching", "step")
    try:
        served = asyncio.run(send_together(one, BODIES))  # together: the adapters take turns
        served += [asyncio.run(send_together(one, [sent]))[0] for sent in BODIES[1:4]]  # one by one
    finally:
        stop_server(one)
    for got, want in zip(served, expected + expected[1:4], strict=True):
        assert np.abs(got - want).max() <= 1
    assert "LoRA ghibli unloaded to make room (--max-loras 1)" in one.log.read_text()


def body_image(server: Server, model: str, seed: int) -> np.ndarray:
    return asyncio.run(send_together(server, [body(model, None, seed)]))[0]


def test_the_readme_lora_example_works(lora_server: Server) -> None:
    (command,) = [c for c in curl_commands() if is_lora(c)]
    assert len(json.loads(run_command_line(command, lora_server.url))["data"]) == 1


def test_a_missing_adapter_stops_the_start_naming_it(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere.safetensors"
    result = subprocess.run(
        [
            str(Path(sys.executable).parent / "diffbatch"),
            "serve",
            "--port",
            "0",
            "--lora-modules",
            f"x={missing}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 1
    assert f"LoRA adapter x: {missing} does not exist" in result.stderr


def _forwards(server: Server, adapter: str) -> float:
    return server.labelled_count(f'diffbatch_lora_forwards_total{{adapter="{adapter}"}}')
