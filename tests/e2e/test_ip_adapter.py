"""A real server with `--ip-adapter`, driven by the official client: a request with a
reference image and a plain one sent together share forwards (the server's own counters say
so) and each gets its image alone; /v1/models lists the IP-Adapter with its model; an
IP-Adapter not served is a 400 naming the field, and the docs' curl line runs."""

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
from tests.e2e.test_readme import is_ip_adapter
from tests.pipelines.engines import difference
from tests.threads import THREADS

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    instance = start_server(
        tmp_path_factory.mktemp("ip_adapter"),
        "--ip-adapter",
        "style=tiny-sd-ip-adapter",
        "--num-threads",
        str(THREADS),
    )
    yield instance
    stop_server(instance)


def reference_url(seed: int) -> str:
    picture = np.random.default_rng(seed).integers(0, 256, (48, 64, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(picture).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


REFERENCED: dict[str, Any] = {
    "seed": 1,
    "num_inference_steps": 6,
    "ip_adapter": [{"name": "style", "image": reference_url(1), "scale": 0.7}],
}
PLAIN: dict[str, Any] = {"seed": 2, "num_inference_steps": 6}


def generate(server: Server, extra: dict[str, Any]) -> np.ndarray:
    with client_for(server) as client:
        result = client.images.generate(model="tiny-sd", prompt="a cat", size="64x64", extra_body=extra)
    return pixels((result.data or [])[0].b64_json)


def test_referenced_and_plain_requests_share_steps_and_each_gets_its_image_alone(server: Server) -> None:
    def send_both() -> list[np.ndarray]:
        with ThreadPoolExecutor(2) as pool:
            return list(pool.map(lambda extra: generate(server, extra), [REFERENCED, PLAIN]))

    together = sent_together(server, send_both)
    for extra, image in zip([REFERENCED, PLAIN], together, strict=True):
        assert difference(image, generate(server, extra)) <= 1
    # The reference image steers: without it the same seed draws another image.
    assert difference(together[0], generate(server, {**REFERENCED, "ip_adapter": None})) > 1


@pytest.mark.parametrize("command", [c for c in command_lines("bash", "curl") if is_ip_adapter(c)])
def test_the_docs_ip_adapter_curl_line_works(server: Server, command: str) -> None:
    live = command.replace("http://localhost:8000", server.url)
    result = subprocess.run(live, shell=True, capture_output=True, text=True, timeout=120, check=False)
    body = json.loads(result.stdout)
    assert "error" not in body, body
    assert body["data"][0]["b64_json"]


def test_models_lists_the_ip_adapter_with_its_model(server: Server) -> None:
    cards = {card["id"]: card for card in httpx.get(f"{server.v1}/models").json()["data"]}
    assert cards["style"]["parent"] == "tiny-sd" and cards["style"]["kind"] == "ip_adapter"


def test_an_ip_adapter_not_served_is_a_400_naming_the_field(server: Server) -> None:
    with client_for(server) as client, pytest.raises(openai.BadRequestError) as refused:
        client.images.generate(
            model="tiny-sd",
            prompt="a cat",
            size="64x64",
            extra_body={"ip_adapter": [{"name": "face", "image": reference_url(1)}]},
        )
    assert refused.value.body["param"] == "ip_adapter[0].name"  # type: ignore[index]


def test_a_reference_that_does_not_decode_is_a_400_naming_its_image(server: Server) -> None:
    response = httpx.post(
        f"{server.v1}/images/generations",
        json={
            "prompt": "a cat",
            "size": "64x64",
            "ip_adapter": [{"name": "style", "image": "bm90IGFuIGltYWdl"}],
        },
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == "ip_adapter[0].image"
