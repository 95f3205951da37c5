"""A real server with `--controlnet` on two text-to-image models (Stable Diffusion, FLUX.1 with
a union ControlNet too), an image-to-image model and an SDXL inpainting model (with SDXL's union
ControlNet too), driven by the
official client: a controlled and an uncontrolled request sent together share forwards (the
server's own counters say so) and each gets its image alone, for generations (JSON) and edits
(the multipart form of `server.control_form`, as the client sends `extra_body`); a union
ControlNet's `mode` steers; /v1/models lists each ControlNet with its model; a ControlNet not
served, a form entry without its image, or a missing or wrong mode is a 400 naming the field."""

from __future__ import annotations

import base64
import io
import json
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
from tests.e2e.test_edits import rgba_mask
from tests.e2e.test_openai_client import client_for, pixels
from tests.e2e.test_readme import is_controlnet
from tests.pipelines.engines import difference
from tests.threads import THREADS

pytestmark = pytest.mark.slow


# The image-to-image model: second, so requests without a model go to text-to-image. Its
# ControlNet has a name of its own (names are unique on a server): the docs' edit line's.
EDIT_MODEL = "tiny-sd-img2img"
# SDXL inpainting (a 9-channel UNet) with SDXL's ControlNet.
INPAINT_MODEL = "tiny-sdxl-inpaint"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    directory = tmp_path_factory.mktemp("controlnet")
    config = directory / "models.yaml"
    config.write_text(
        "models:\n"
        "  - {name: tiny-sd, model: tiny-sd, controlnet: {edges: tiny-sd-controlnet}}\n"
        f"  - {{name: {EDIT_MODEL}, model: tiny-sd, controlnet: {{depth: tiny-sd-controlnet}}, "
        "pipeline_class: 'pipelines.registry:StableDiffusionImageToImage'}\n"
        "  - {name: tiny-flux, model: tiny-flux, controlnet: {lines: tiny-flux-controlnet, "
        "union: tiny-flux-controlnet-union}}\n"
        f"  - {{name: {INPAINT_MODEL}, model: tiny-sdxl-inpaint, "
        "controlnet: {sketch: tiny-sdxl-controlnet, fused: tiny-sdxl-controlnet-union}}\n"
    )
    instance = start_server(directory, "--config", str(config), "--num-threads", str(THREADS), config=None)
    yield instance
    stop_server(instance)


def png(seed: int) -> bytes:
    picture = np.random.default_rng(seed).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(picture).save(buffer, format="PNG")
    return buffer.getvalue()


def control_url(seed: int) -> str:
    return "data:image/png;base64," + base64.b64encode(png(seed)).decode()


CONTROLLED: dict[str, Any] = {
    "seed": 1,
    "num_inference_steps": 6,
    "controlnet": [{"name": "edges", "image": control_url(1), "scale": 0.8, "end": 0.75}],
}
PLAIN: dict[str, Any] = {"seed": 2, "num_inference_steps": 6}
# FLUX.1: its control image is drawn from the request's seed, before the noise.
FLUX_CONTROLLED: dict[str, Any] = {
    "seed": 3,
    "num_inference_steps": 4,
    "controlnet": [{"name": "lines", "image": control_url(2), "scale": 0.7, "start": 0.25}],
}
FLUX_PLAIN: dict[str, Any] = {"seed": 4, "num_inference_steps": 4}


def generate(server: Server, extra: dict[str, Any], model: str = "tiny-sd") -> np.ndarray:
    with client_for(server) as client:
        result = client.images.generate(model=model, prompt="a cat", size="64x64", extra_body=extra)
    return pixels((result.data or [])[0].b64_json)


@pytest.mark.parametrize(
    ("model", "controlled", "plain"),
    [("tiny-sd", CONTROLLED, PLAIN), ("tiny-flux", FLUX_CONTROLLED, FLUX_PLAIN)],
)
def test_controlled_and_plain_requests_share_steps_and_each_gets_its_image_alone(
    server: Server, model: str, controlled: dict[str, Any], plain: dict[str, Any]
) -> None:
    def send_both() -> list[np.ndarray]:
        with ThreadPoolExecutor(2) as pool:
            return list(pool.map(lambda extra: generate(server, extra, model), [controlled, plain]))

    together = sent_together(server, send_both)
    for extra, image in zip([controlled, plain], together, strict=True):
        assert difference(image, generate(server, extra, model)) <= 1
    # The control image steers: without it the same seed draws another image.
    assert difference(together[0], generate(server, {**controlled, "controlnet": None}, model)) > 1


EDIT_CONTROLLED: dict[str, Any] = {
    "seed": 3,
    "num_inference_steps": 5,
    "strength": 0.8,
    # The client sends these as form fields controlnet[][name], controlnet[][image], ...
    "controlnet": [{"name": "depth", "image": control_url(4), "scale": 0.9, "start": 0.2}],
}
EDIT_PLAIN: dict[str, Any] = {"seed": 5, "num_inference_steps": 5, "strength": 0.8}
INPAINT_CONTROLLED: dict[str, Any] = {
    "seed": 6,
    "num_inference_steps": 4,
    "controlnet": [{"name": "sketch", "image": control_url(5), "scale": 0.7, "end": 0.8}],
}
INPAINT_PLAIN: dict[str, Any] = {"seed": 7, "num_inference_steps": 4}


def hole() -> bytes:
    """The inpainting model repaints a box: OpenAI's mask, transparent there."""
    return rgba_mask(64, 64, (8, 16, 40, 48))


def edit(server: Server, extra: dict[str, Any], model: str = EDIT_MODEL) -> np.ndarray:
    with client_for(server) as client:
        result = client.images.edit(
            model=model,
            image=("photo.png", png(20), "image/png"),
            prompt="a cat",
            size="64x64",
            extra_body=extra,
            mask=("mask.png", hole(), "image/png") if model == INPAINT_MODEL else openai.omit,
        )
    return pixels((result.data or [])[0].b64_json)


@pytest.mark.parametrize(
    ("model", "controlled", "plain"),
    [(EDIT_MODEL, EDIT_CONTROLLED, EDIT_PLAIN), (INPAINT_MODEL, INPAINT_CONTROLLED, INPAINT_PLAIN)],
)
def test_controlled_and_plain_edits_share_steps_and_each_gets_its_image_alone(
    server: Server, model: str, controlled: dict[str, Any], plain: dict[str, Any]
) -> None:
    def send_both() -> list[np.ndarray]:
        with ThreadPoolExecutor(2) as pool:
            return list(pool.map(lambda extra: edit(server, extra, model), [controlled, plain]))

    together = sent_together(server, send_both)
    for extra, image in zip([controlled, plain], together, strict=True):
        assert difference(image, edit(server, extra, model)) <= 1
    uncontrolled = {key: value for key, value in controlled.items() if key != "controlnet"}
    assert difference(together[0], edit(server, uncontrolled, model)) > 1


def test_a_form_entry_is_checked_naming_its_field(server: Server) -> None:
    def refused(fields: dict[str, str]) -> str:
        files = {"image": ("photo.png", png(20), "image/png")}
        data = {"model": EDIT_MODEL, "prompt": "a cat", **fields}
        answer = httpx.post(f"{server.v1}/images/edits", data=data, files=files, timeout=60)
        assert answer.status_code == 400, answer.text
        return str(answer.json()["error"]["param"])

    assert refused({"controlnet[0][name]": "depth"}) == "controlnet[0].image"
    assert (
        refused(
            {
                "controlnet[0][name]": "depth",
                "controlnet[0][image]": control_url(1),
                "controlnet[0][scale]": "x",
            }
        )
        == "controlnet[0].scale"
    )
    assert refused({"controlnet[1][name]": "depth", "controlnet[1][image]": control_url(1)}) == "controlnet"
    assert (
        refused({"controlnet[0][name]": "edges", "controlnet[0][image]": control_url(1)})
        == "controlnet[0].name"
    )
    assert refused({"controlnet": "depth"}) == "controlnet"
    # A form's mode reaches admission: depth is not a union ControlNet.
    depth = {"controlnet[0][name]": "depth", "controlnet[0][image]": control_url(1)}
    assert refused({**depth, "controlnet[0][mode]": "1"}) == "controlnet[0].mode"


@pytest.mark.parametrize("command", [c for c in command_lines("bash", "curl") if is_controlnet(c)])
def test_the_docs_controlnet_curl_lines_work(server: Server, command: str, tmp_path: Path) -> None:
    """Run where the edit line's photo.png and depth.png are; the edit line goes to the
    image-to-image model, which a server of its own would serve by default."""
    (tmp_path / "photo.png").write_bytes(png(20))
    (tmp_path / "depth.png").write_bytes(png(21))
    if "/v1/images/edits" in command:
        command += f" -F model={EDIT_MODEL}"
    body = json.loads(run_command_line(command, server.url, tmp_path))
    assert "error" not in body, body
    assert body["data"][0]["b64_json"]


def test_models_lists_the_controlnet_with_its_model(server: Server) -> None:
    cards = {card["id"]: card for card in httpx.get(f"{server.v1}/models").json()["data"]}
    assert cards["edges"]["parent"] == "tiny-sd" and cards["edges"]["kind"] == "controlnet"
    assert cards["lines"]["parent"] == "tiny-flux" and cards["lines"]["kind"] == "controlnet"
    # A union ControlNet's card names its modes by number; the others' none.
    assert cards["union"]["modes"] == ["canny", "tile", "depth", "blur"]
    assert cards["fused"]["modes"] == [
        "openpose",
        "depth",
        "hed/scribble",
        "canny/lineart",
        "normal",
        "segment",
    ]
    assert cards["fused"]["parent"] == INPAINT_MODEL and cards["lines"]["modes"] is None


def test_a_union_controlnets_mode_steers_and_is_checked(server: Server) -> None:
    """Two modes of one control image draw two images; a union entry without a mode, or a
    mode on a ControlNet of one kind, is a 400 naming its `mode`. SDXL's union ControlNet
    takes an edit's two images of two modes, and no other ControlNet beside it."""

    def union(mode: int | None, name: str = "union") -> dict[str, Any]:
        entry = {"name": name, "image": control_url(6), "mode": mode}
        return {
            "seed": 8,
            "num_inference_steps": 4,
            "controlnet": [{k: v for k, v in entry.items() if v is not None}],
        }

    assert difference(generate(server, union(0), "tiny-flux"), generate(server, union(3), "tiny-flux")) > 1
    for wrong in (union(None), union(4), union(1, "lines")):
        with client_for(server) as client, pytest.raises(openai.BadRequestError) as refused:
            client.images.generate(model="tiny-flux", prompt="a cat", size="64x64", extra_body=wrong)
        assert refused.value.body["param"] == "controlnet[0].mode"  # type: ignore[index]

    # SDXL's union ControlNet fuses an edit's two images (two modes) in one pass, and takes no
    # other ControlNet beside it in a request. Indexed form fields, flat in `extra_body`: the
    # client would send a list's entries field by field, which reads as other entries.
    def fused(second: dict[str, Any]) -> dict[str, Any]:
        first = {"name": "fused", "image": control_url(6), "mode": 1}
        entries = (first, second)
        return {f"controlnet[{i}][{k}]": v for i, e in enumerate(entries) for k, v in e.items()}

    two = fused({"name": "fused", "image": control_url(7), "mode": 3, "scale": 0.5})
    plain = edit(server, INPAINT_PLAIN, INPAINT_MODEL)
    assert difference(edit(server, {**INPAINT_PLAIN, **two}, INPAINT_MODEL), plain) > 1
    with pytest.raises(openai.BadRequestError) as refused:
        edit(server, {**INPAINT_PLAIN, **fused({"name": "sketch", "image": control_url(7)})}, INPAINT_MODEL)
    assert refused.value.body["param"] == "controlnet[1].name"  # type: ignore[index]


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
