"""`images.edit` with the official client against a real `diffbatch serve tiny-qwen-image-edit`."""

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
from openai.types import ImagesResponse
from PIL import Image

from bench.launch import ServerProcess as Server
from bench.launch import start_server, stop_server
from engine.request import GenerationRequest, SamplingParams
from pipelines.adapter import DiffusersAdapter
from pipelines.base import PipelineConfig
from pipelines.registry import load_pipeline
from tests.doc_pages import command_lines, run_command_line
from tests.e2e.sharing import sent_together
from tests.e2e.test_readme import curl_commands, is_controlnet, is_edit, is_ip_adapter
from tests.media import picture, png
from tests.pipelines.stock import stock_output


def encoded(image: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG")
    return buffer.getvalue()


pytestmark = pytest.mark.slow


def create_variation(client: openai.OpenAI, **fields: Any) -> ImagesResponse:
    """`client.images.create_variation`, which the client marks deprecated (OpenAI's own image
    models no longer take it), not wrong."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return client.images.create_variation(**fields)


@pytest.fixture(scope="module")
def qwen_edit(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """Qwen-Image-Edit in step batching for the module's edit tests. Each edit costs its
    latents and its reference's (the condition size, ~1 MP: about 1,000 tokens, twice that
    with true CFG): the default step budget (1,024) would run each alone."""
    args = ("--batching", "step", "--max-step-tokens", "65536")
    server = start_server(tmp_path_factory.mktemp("qwen-edit"), "tiny-qwen-image-edit", *args, config=None)
    yield server
    stop_server(server)


def test_edit_with_the_official_client(qwen_edit: Server) -> None:
    server = qwen_edit
    with openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0) as client:
        result = client.images.edit(
            image=("photo.png", png(48, 32), "image/png"),
            prompt="make the sky orange",
            size="64x32",
            extra_body={"seed": 3, "num_inference_steps": 2},
        )
        assert result.data is not None and len(result.data) == 1
        image = Image.open(io.BytesIO(base64.b64decode(result.data[0].b64_json or "")))
        assert image.size == (64, 32)
        with pytest.raises(openai.BadRequestError) as raised:
            client.images.edit(image=("notes.txt", b"not an image", "text/plain"), prompt="x")
        assert raised.value.body["param"] == "image"  # type: ignore[index]
        # An edit model that does no image-to-image cannot draw variations.
        with pytest.raises(openai.BadRequestError) as no_variations:
            create_variation(client, image=("photo.png", png(48, 32), "image/png"))
        assert no_variations.value.body["param"] == "model"  # type: ignore[index]
        assert "does not do image-to-image" in no_variations.value.body["message"]  # type: ignore[index]


def test_edits_step_together_and_stream_previews(qwen_edit: Server) -> None:
    """`--batching step`: edits with different steps and negative prompts share denoiser
    forwards, each is the image diffusers' own call makes for it alone, and a streamed edit
    previews."""
    server = qwen_edit
    bodies: list[dict[str, Any]] = [
        {"seed": 1, "num_inference_steps": 3},
        {"seed": 2, "num_inference_steps": 5, "negative_prompt": "blurry", "true_cfg_scale": 2.0},
    ]
    with openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0) as client:

        def edit(body: dict[str, Any], photo: bytes) -> bytes:
            result = client.images.edit(
                image=("photo.png", photo, "image/png"),
                prompt="make it blue",
                size="64x32",
                extra_body=body,
            )
            assert result.data is not None
            return base64.b64decode(result.data[0].b64_json or "")

        photos = [encoded(picture(48, 32, 1)), encoded(picture(96, 64, 2))]  # one aspect ratio

        def send() -> list[bytes]:
            with ThreadPoolExecutor(2) as pool:
                return list(pool.map(edit, bodies, photos))

        served = sent_together(server, send)
        events = list(
            client.images.edit(
                image=("photo.png", photos[0], "image/png"),
                prompt="make it blue",
                size="64x32",
                stream=True,
                partial_images=1,
                extra_body=bodies[0],
            )
        )
    log = server.log.read_text()
    assert "step-level batching" in log
    assert [e.type for e in events] == ["image_edit.partial_image", "image_edit.completed"]
    # The streamed edit ran alone, the first shared its steps: the same image within 1/255.
    streamed = Image.open(io.BytesIO(base64.b64decode(events[1].b64_json))).convert("RGB")
    first = Image.open(io.BytesIO(served[0])).convert("RGB")
    assert np.abs(np.asarray(streamed).astype(int) - np.asarray(first).astype(int)).max() <= 1

    pipeline = load_pipeline(PipelineConfig(model="tiny-qwen-image-edit", num_threads=1))
    assert isinstance(pipeline, DiffusersAdapter)
    for body, photo, got in zip(bodies, photos, served, strict=True):
        image = np.asarray(Image.open(io.BytesIO(photo)).convert("RGB"))
        params = SamplingParams(width=64, height=32, **body)
        request = GenerationRequest.create("make it blue", params, input_images=(image,))
        alone = stock_output(pipeline, request.with_params(pipeline.resolve(request)))
        served_pixels = np.asarray(Image.open(io.BytesIO(got)).convert("RGB")).astype(int)
        assert np.abs(served_pixels - alone.images[0].astype(int)).max() <= 1


def rgba_mask(width: int, height: int, hole: tuple[int, int, int, int]) -> bytes:
    """OpenAI's mask: opaque everywhere except a fully transparent box (left, top, right,
    bottom) marking the area to edit."""
    alpha = np.full((height, width), 255, np.uint8)
    left, top, right, bottom = hole
    alpha[top:bottom, left:right] = 0
    rgba = np.dstack([np.zeros((height, width, 3), np.uint8), alpha])
    buffer = io.BytesIO()
    Image.fromarray(rgba, "RGBA").save(buffer, format="PNG")
    return buffer.getvalue()


# Inpainting servers, shared by the mask test and the docs' edit lines.
INPAINTING = {
    "tiny-sd-inpaint": (),  # an inpainting checkpoint, found by its model index
    "tiny-sdxl": ("--pipeline-class", "pipelines.registry:StableDiffusionXLInpaint"),
}


@pytest.fixture(scope="module", params=list(INPAINTING))
def inpainting(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Server]]:
    model = request.param
    args = (*INPAINTING[model], "--batching", "step")
    server = start_server(tmp_path_factory.mktemp("inpainting"), model, *args, config=None)
    yield model, server
    stop_server(server)


def test_inpainting_with_an_rgba_mask_repaints_only_the_transparent_area(
    inpainting: tuple[str, Server],
) -> None:
    """Served step-level (each request counted at every step it took), with different step
    counts, and a streamed one previews with the input kept outside the mask, as its final
    image."""
    _, server = inpainting
    rows_before = server.metric("diffbatch_batch_size_sum")
    log = server.log.read_text()
    assert "step-level batching" in log and "cannot step requests together" not in log
    photo = picture(64, 64, seed=5)
    hole = (16, 8, 48, 40)
    mask = ("mask.png", rgba_mask(64, 64, hole), "image/png")
    with (
        openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0) as client,
        ThreadPoolExecutor(4) as pool,
    ):
        futures = [
            pool.submit(
                client.images.edit,
                image=("photo.png", encoded(photo), "image/png"),
                mask=mask,
                prompt=f"a red ball {i}",
                extra_body={"seed": i, "num_inference_steps": 3 + i},
            )
            for i in range(4)
        ]
        results = [f.result(timeout=300) for f in futures]
        events = list(
            client.images.edit(
                image=("photo.png", encoded(photo), "image/png"),
                mask=mask,
                prompt="a red ball",
                stream=True,
                partial_images=1,
                extra_body={"seed": 9, "num_inference_steps": 4},
            )
        )
        with pytest.raises(openai.BadRequestError) as no_alpha:
            client.images.edit(
                image=("photo.png", encoded(photo), "image/png"),
                mask=("mask.png", png(64, 64, mode="L"), "image/png"),
                prompt="x",
            )
        assert no_alpha.value.body["param"] == "mask"  # type: ignore[index]
    left, top, right, bottom = hole
    inside = np.zeros((64, 64), bool)
    inside[top:bottom, left:right] = True
    assert [e.type for e in events] == ["image_edit.partial_image", "image_edit.completed"]
    b64 = [r.data[0].b64_json if r.data else None for r in results] + [e.b64_json for e in events]
    for data in b64:
        image = np.asarray(Image.open(io.BytesIO(base64.b64decode(data or ""))))
        assert np.array_equal(image[~inside], photo[~inside])  # kept, pixel for pixel
        assert (image[inside] != photo[inside]).mean() > 0.5  # repainted
    # Each request step by step (3 + 4 + 5 + 6, and the streamed one's 4): step-level.
    assert server.metric("diffbatch_batch_size_sum") - rows_before == 22


# On the Stable Diffusion inpainting server: the other is the same inpainting task.
@pytest.mark.parametrize("inpainting", ["tiny-sd-inpaint"], indirect=True)
def test_the_docs_edit_curl_lines_work(
    qwen_edit: Server, inpainting: tuple[str, Server], tmp_path: Path
) -> None:
    """The docs' edit lines against Qwen-Image-Edit, and the line with a mask against an
    inpainting model, with a photo.png and an RGBA mask.png in the working directory."""
    Image.new("RGB", (48, 32), (30, 120, 200)).save(tmp_path / "photo.png")
    mask = Image.new("RGBA", (48, 32), (0, 0, 0, 255))
    mask.paste((0, 0, 0, 0), (8, 8, 40, 24))  # the transparent area is the one to edit
    mask.save(tmp_path / "mask.png")
    edits = [c for c in curl_commands() if is_edit(c) and not (is_controlnet(c) or is_ip_adapter(c))]
    assert any("mask=@" in c for c in edits) and any("mask=@" not in c for c in edits)
    for command in edits:
        server, size = (inpainting[1], "48x32") if "mask=@" in command else (qwen_edit, "64x64")
        body = json.loads(run_command_line(command, server.url, tmp_path))
        assert body.get("error") is None and body["size"] == size, body


# Image-to-image servers, shared by the strength and the variation tests.
IMAGE_TO_IMAGE = {
    "tiny-sd": ("--pipeline-class", "pipelines.registry:StableDiffusionImageToImage"),
    "tiny-sdxl-refiner": (),  # an img2img checkpoint: its model index names the pipeline
}


@pytest.fixture(scope="module", params=list(IMAGE_TO_IMAGE))
def img2img(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Server]]:
    model = request.param
    server = start_server(tmp_path_factory.mktemp("img2img"), model, *IMAGE_TO_IMAGE[model], config=None)
    yield model, server
    stop_server(server)


def test_image_to_image_with_strength_through_the_official_client(img2img: tuple[str, Server]) -> None:
    _, server = img2img
    with openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0) as client:
        result = client.images.edit(
            image=("photo.png", encoded(picture(48, 40, seed=2)), "image/png"),
            prompt="as an oil painting",
            extra_body={"strength": 0.6, "seed": 1, "num_inference_steps": 4},
        )
        assert result.data is not None and result.size == "48x40"
        assert "cannot step requests together" not in server.log.read_text()  # served step-level
        with pytest.raises(openai.BadRequestError) as raised:
            client.images.edit(
                image=("photo.png", encoded(picture(48, 40, seed=2)), "image/png"),
                prompt="x",
                extra_body={"strength": 1.5},
            )
        assert raised.value.body["param"] == "strength"  # type: ignore[index]


# On one of the servers: the other is the same image-to-image task (its loaded oracle costs 15 s).
@pytest.mark.parametrize("img2img", ["tiny-sd"], indirect=True)
def test_variations_are_image_to_image_with_no_prompt(img2img: tuple[str, Server], tmp_path: Path) -> None:
    """`images.create_variation`: each of n images is diffusers' own img2img call with the
    documented prompt ("") and strength (0.7) at its seed, run alone; as URLs too; a file
    that is not an image is a 400 naming `image`; the docs' curl lines work."""
    model, server = img2img
    photo = picture(48, 40, seed=4)
    Image.fromarray(photo).save(tmp_path / "photo.png")
    for command in (c for c in command_lines("bash", "curl") if "/v1/images/variations" in c):
        body = json.loads(run_command_line(command, server.url, tmp_path))
        assert body.get("error") is None and body["size"] == "64x48" and len(body["data"]) == 2, body
    with openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0) as client:
        result = create_variation(
            client,
            image=("photo.png", encoded(photo), "image/png"),
            n=2,
            size="64x48",  # any size the model takes (the client types three)
            extra_body={"seed": 11, "num_inference_steps": 4},
        )
        linked = create_variation(
            client,
            image=("photo.png", encoded(photo), "image/png"),
            response_format="url",
            extra_body={"seed": 11, "num_inference_steps": 4},
        )
        with pytest.raises(openai.BadRequestError) as not_an_image:
            create_variation(client, image=("notes.txt", b"not an image", "text/plain"))
    assert not_an_image.value.body["param"] == "image"  # type: ignore[index]
    assert result.data is not None and [d.seed for d in result.data] == [11, 12]  # type: ignore[attr-defined]
    assert linked.data is not None and linked.data[0].url is not None
    at_input_size = Image.open(io.BytesIO(httpx.get(linked.data[0].url).content))
    assert at_input_size.format == "PNG" and at_input_size.size == (48, 40)  # size defaults to the input's

    pipeline = load_pipeline(
        PipelineConfig(model=model, num_threads=1, pipeline_class=_pipeline_class(IMAGE_TO_IMAGE[model]))
    )
    assert isinstance(pipeline, DiffusersAdapter)
    params = SamplingParams(width=64, height=48, n=2, seed=11, num_inference_steps=4, strength=0.7)
    request = GenerationRequest.create("", params, input_images=(photo,))
    alone = stock_output(pipeline, request.with_params(pipeline.resolve(request)))
    for data, expected in zip(result.data, alone.images, strict=True):
        served = np.asarray(Image.open(io.BytesIO(base64.b64decode(data.b64_json or ""))).convert("RGB"))
        assert np.abs(served.astype(int) - expected.astype(int)).max() <= 1


def _pipeline_class(flags: tuple[str, ...]) -> str | None:
    return flags[flags.index("--pipeline-class") + 1] if "--pipeline-class" in flags else None
