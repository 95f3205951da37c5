"""A real server with `--ip-adapter` on a text-to-image and an image-to-image model, driven by
the official client: a request with a reference image and a plain one sent together share
forwards (the server's own counters say so) and each gets its image alone, for generations
(JSON) and edits (the multipart form of `server.control_form`, as the client sends
`extra_body`); `images.create_variation` draws with the model's IP-Adapter (steered by the
image: another image, same seed, another variation); /v1/models lists each IP-Adapter with its
model; an IP-Adapter not served is a 400 naming the field, and the docs' curl lines run. A
FLUX.1 model served with a Redux prior draws its variations with it."""

from __future__ import annotations

import base64
import io
import json
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from tests.doc_pages import command_lines, run_command_line
from tests.e2e.conftest import Server, start_server, stop_server
from tests.e2e.sharing import sent_together
from tests.e2e.test_openai_client import client_for, pixels
from tests.e2e.test_readme import is_ip_adapter
from tests.pipelines.engines import difference
from tests.threads import THREADS

pytestmark = pytest.mark.slow

# The image-to-image model: second, so requests without a model go to text-to-image. Its
# IP-Adapter has a name of its own (names are unique on a server): the docs' edit line's.
EDIT_MODEL = "tiny-sd-img2img"
# A FLUX.1 model with a Redux prior, for variations.
REDUX_MODEL = "tiny-flux"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    directory = tmp_path_factory.mktemp("ip_adapter")
    config = directory / "models.yaml"
    config.write_text(
        "models:\n"
        "  - {name: tiny-sd, model: tiny-sd, ip_adapter: {style: tiny-sd-ip-adapter}}\n"
        f"  - {{name: {EDIT_MODEL}, model: tiny-sd, ip_adapter: {{look: tiny-sd-ip-adapter}}, "
        "pipeline_class: 'pipelines.registry:StableDiffusionImageToImage'}\n"
        f"  - {{name: {REDUX_MODEL}, model: tiny-flux, ip_adapter: {{redux: tiny-flux-redux}}}}\n"
    )
    instance = start_server(directory, "--config", str(config), "--num-threads", str(THREADS), config=None)
    yield instance
    stop_server(instance)


def png(seed: int, size: tuple[int, int] = (48, 64)) -> bytes:
    picture = np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(picture).save(buffer, format="PNG")
    return buffer.getvalue()


def reference_url(seed: int) -> str:
    return "data:image/png;base64," + base64.b64encode(png(seed)).decode()


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


EDIT_REFERENCED: dict[str, Any] = {
    "seed": 3,
    "num_inference_steps": 5,
    "strength": 0.8,
    # The client sends these as form fields ip_adapter[][name], ip_adapter[][image], ...
    "ip_adapter": [{"name": "look", "image": reference_url(4), "scale": 0.9}],
}
EDIT_PLAIN: dict[str, Any] = {"seed": 5, "num_inference_steps": 5, "strength": 0.8}


def edit(server: Server, extra: dict[str, Any]) -> np.ndarray:
    with client_for(server) as client:
        result = client.images.edit(
            model=EDIT_MODEL,
            image=("photo.png", png(20, (64, 64)), "image/png"),
            prompt="a cat",
            size="64x64",
            extra_body=extra,
        )
    return pixels((result.data or [])[0].b64_json)


def test_referenced_and_plain_edits_share_steps_and_each_gets_its_image_alone(server: Server) -> None:
    def send_both() -> list[np.ndarray]:
        with ThreadPoolExecutor(2) as pool:
            return list(pool.map(lambda extra: edit(server, extra), [EDIT_REFERENCED, EDIT_PLAIN]))

    together = sent_together(server, send_both)
    for extra, image in zip([EDIT_REFERENCED, EDIT_PLAIN], together, strict=True):
        assert difference(image, edit(server, extra)) <= 1
    unreferenced = {key: value for key, value in EDIT_REFERENCED.items() if key != "ip_adapter"}
    assert difference(together[0], edit(server, unreferenced)) > 1


def test_a_form_entry_is_checked_naming_its_field(server: Server) -> None:
    def refused(fields: dict[str, str]) -> str:
        files = {"image": ("photo.png", png(20), "image/png")}
        data = {"model": EDIT_MODEL, "prompt": "a cat", **fields}
        answer = httpx.post(f"{server.v1}/images/edits", data=data, files=files, timeout=60)
        assert answer.status_code == 400, answer.text
        return str(answer.json()["error"]["param"])

    assert refused({"ip_adapter[0][name]": "look"}) == "ip_adapter[0].image"
    bad_scale = {
        "ip_adapter[0][name]": "look",
        "ip_adapter[0][image]": reference_url(1),
        "ip_adapter[0][scale]": "3",
    }
    assert refused(bad_scale) == "ip_adapter[0].scale"
    assert (
        refused({"ip_adapter[0][name]": "style", "ip_adapter[0][image]": reference_url(1)})
        == "ip_adapter[0].name"
    )
    assert refused({"ip_adapter": "look"}) == "ip_adapter"


def create_variation(model: str, server: Server, seed: int, picture: bytes) -> np.ndarray:
    """`client.images.create_variation`, which the client marks deprecated (OpenAI's own image
    models no longer take it), not wrong."""
    with client_for(server) as client, warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        result = client.images.create_variation(
            model=model,
            image=("photo.png", picture, "image/png"),
            # Any size the model takes (the client types three).
            size="64x64",  # type: ignore[arg-type]
            extra_body={"seed": seed, "num_inference_steps": 4},
        )
    return pixels((result.data or [])[0].b64_json)


@pytest.mark.parametrize("model", ["tiny-sd", EDIT_MODEL, REDUX_MODEL])
def test_variations_are_drawn_with_the_models_ip_adapter(server: Server, model: str) -> None:
    """A text-to-image model draws a variation from the image's embedding alone (FLUX Redux:
    from the image's SigLIP tokens as its text), an image-to-image model from its pixels too:
    either way, with the same seed, another image
    draws another variation, and the same image the same one."""
    first = create_variation(model, server, 7, png(30, (64, 64)))
    assert difference(first, create_variation(model, server, 7, png(30, (64, 64)))) <= 1
    assert difference(first, create_variation(model, server, 7, png(31, (64, 64)))) > 1


def test_a_text_to_image_variation_takes_no_strength(server: Server) -> None:
    files = {"image": ("photo.png", png(30), "image/png")}
    answer = httpx.post(f"{server.v1}/images/variations", data={"strength": "0.5"}, files=files, timeout=60)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "strength", answer.text


@pytest.mark.parametrize("command", [c for c in command_lines("bash", "curl") if is_ip_adapter(c)])
def test_the_docs_ip_adapter_curl_lines_work(server: Server, command: str, tmp_path: Path) -> None:
    """Run where the edit line's photo.png and reference.png are; the edit line goes to the
    image-to-image model, which a server of its own would serve by default."""
    (tmp_path / "photo.png").write_bytes(png(20))
    (tmp_path / "reference.png").write_bytes(png(21))
    if "/v1/images/edits" in command:
        command += f" -F model={EDIT_MODEL}"
    body = json.loads(run_command_line(command, server.url, tmp_path))
    assert "error" not in body, body
    assert body["data"][0]["b64_json"]


def test_models_lists_the_ip_adapter_with_its_model(server: Server) -> None:
    cards = {card["id"]: card for card in httpx.get(f"{server.v1}/models").json()["data"]}
    assert cards["style"]["parent"] == "tiny-sd" and cards["style"]["kind"] == "ip_adapter"
    assert cards["look"]["parent"] == EDIT_MODEL and cards["look"]["kind"] == "ip_adapter"


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
