"""A real server with `--controlnet`, driven by the official client: a controlled and an
uncontrolled request sent together share forwards (the server's own counters say so) and
each gets its image alone; /v1/models lists the ControlNet with its model; a ControlNet
not served is a 400 naming the field."""

from __future__ import annotations

import base64
import io
import json
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from tests.doc_pages import command_lines
from tests.e2e.conftest import Server, start_server, stop_server
from tests.e2e.sharing import sent_together
from tests.e2e.test_openai_client import client_for, pixels
from tests.e2e.test_readme import is_controlnet
from tests.pipelines.engines import difference
from tests.threads import THREADS

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    instance = start_server(
        tmp_path_factory.mktemp("controlnet"),
        "--controlnet",
        "edges=tiny-sd-controlnet",
        "--num-threads",
        str(THREADS),
    )
    yield instance
    stop_server(instance)


def control_url(seed: int) -> str:
    picture = np.random.default_rng(seed).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(picture).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


CONTROLLED: dict[str, Any] = {
    "seed": 1,
    "num_inference_steps": 6,
    "controlnet": [{"name": "edges", "image": control_url(1), "scale": 0.8, "end": 0.75}],
}
PLAIN: dict[str, Any] = {"seed": 2, "num_inference_steps": 6}


def generate(server: Server, extra: dict[str, Any]) -> np.ndarray:
    with client_for(server) as client:
        result = client.images.generate(model="tiny-sd", prompt="a cat", size="64x64", extra_body=extra)
    return pixels((result.data or [])[0].b64_json)


def test_controlled_and_plain_requests_share_steps_and_each_gets_its_image_alone(server: Server) -> None:
    def send_both() -> list[np.ndarray]:
        with ThreadPoolExecutor(2) as pool:
            return list(pool.map(lambda extra: generate(server, extra), [CONTROLLED, PLAIN]))

    together = sent_together(server, send_both)
    for extra, image in zip([CONTROLLED, PLAIN], together, strict=True):
        assert difference(image, generate(server, extra)) <= 1
    # The control image steers: without it the same seed draws another image.
    assert difference(together[0], generate(server, {**CONTROLLED, "controlnet": None})) > 1


@pytest.mark.parametrize("command", [c for c in command_lines("bash", "curl") if is_controlnet(c)])
def test_the_docs_controlnet_curl_line_works(server: Server, command: str) -> None:
    live = command.replace("http://localhost:8000", server.url)
    result = subprocess.run(live, shell=True, capture_output=True, text=True, timeout=120, check=False)
    body = json.loads(result.stdout)
    assert "error" not in body, body
    assert body["data"][0]["b64_json"]


def test_models_lists_the_controlnet_with_its_model(server: Server) -> None:
    cards = {card["id"]: card for card in httpx.get(f"{server.v1}/models").json()["data"]}
    assert cards["edges"]["parent"] == "tiny-sd" and cards["edges"]["kind"] == "controlnet"


def test_a_controlnet_not_served_is_a_400_naming_the_field(server: Server) -> None:
    with client_for(server) as client, pytest.raises(openai.BadRequestError) as refused:
        client.images.generate(
            model="tiny-sd",
            prompt="a cat",
            size="64x64",
            extra_body={
                "controlnet": [{"name": "edges", "image": control_url(1)}, {"name": "pose", "image": "x"}]
            },
        )
    assert refused.value.body["param"] == "controlnet[1].name"  # type: ignore[index]
