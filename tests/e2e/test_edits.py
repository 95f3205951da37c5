"""`images.edit` with the official client against a real `diffbatch serve tiny-qwen-image-edit`."""

from __future__ import annotations

import base64
import io
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
from PIL import Image

from bench.launch import start_server, stop_server
from engine.request import GenerationRequest, SamplingParams
from pipelines.adapter import DiffusersAdapter
from pipelines.base import PipelineConfig
from pipelines.registry import load_pipeline
from tests.e2e.sharing import sent_together
from tests.media import picture, png
from tests.pipelines.stock import stock_output


def encoded(image: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG")
    return buffer.getvalue()


pytestmark = pytest.mark.slow


def test_edit_with_the_official_client(tmp_path: Path) -> None:
    server = start_server(tmp_path, "tiny-qwen-image-edit", config=None)
    try:
        with openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0) as client:
            result = client.images.edit(
                image=("photo.png", png(48, 32), "image/png"),
                prompt="make the sky orange",
                size="64x48",
                extra_body={"seed": 3, "num_inference_steps": 2},
            )
            assert result.data is not None and len(result.data) == 1
            image = Image.open(io.BytesIO(base64.b64decode(result.data[0].b64_json or "")))
            assert image.size == (64, 48)
            with pytest.raises(openai.BadRequestError) as raised:
                client.images.edit(image=("notes.txt", b"not an image", "text/plain"), prompt="x")
            assert raised.value.body["param"] == "image"  # type: ignore[index]
    finally:
        stop_server(server)


def test_edits_step_together_and_stream_previews(tmp_path: Path) -> None:
    """`--batching step`: edits with different steps and negative prompts share denoiser
    forwards, each is the image diffusers' own call makes for it alone, and a streamed edit
    previews."""
    # Each edit costs its latents and its reference's (the condition size, ~1 MP: 16,272 and,
    # with true CFG, 32,544 tokens): the default step budget (1,024) would run each alone.
    args = ("--batching", "step", "--max-step-tokens", "65536")
    server = start_server(tmp_path, "tiny-qwen-image-edit", *args, config=None)
    bodies: list[dict[str, Any]] = [
        {"seed": 1, "num_inference_steps": 3},
        {"seed": 2, "num_inference_steps": 5, "negative_prompt": "blurry", "true_cfg_scale": 2.0},
    ]
    try:
        with openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0) as client:

            def edit(body: dict[str, Any], photo: bytes) -> bytes:
                result = client.images.edit(
                    image=("photo.png", photo, "image/png"),
                    prompt="make it blue",
                    size="64x48",
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
                    size="64x48",
                    stream=True,
                    partial_images=1,
                    extra_body=bodies[0],
                )
            )
            log = server.log.read_text()
    finally:
        stop_server(server)
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
        params = SamplingParams(width=64, height=48, **body)
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


@pytest.mark.parametrize(
    ("model", "flags"),
    [
        ("tiny-sd-inpaint", ()),  # an inpainting checkpoint, found by its model index
        ("tiny-sdxl", ("--pipeline-class", "pipelines.registry:StableDiffusionXLInpaint")),
    ],
)
def test_inpainting_with_an_rgba_mask_repaints_only_the_transparent_area(
    tmp_path: Path, model: str, flags: tuple[str, ...]
) -> None:
    """Served step-level (each request counted at every step it took), with different step
    counts, and a streamed one previews with the input kept outside the mask, as its final
    image."""
    server = start_server(tmp_path, model, *flags, "--batching", "step", config=None)
    try:
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
        assert server.metric("diffbatch_batch_size_sum") == 22
    finally:
        stop_server(server)


@pytest.mark.parametrize(
    ("model", "flags"),
    [
        ("tiny-sd", ("--pipeline-class", "pipelines.registry:StableDiffusionImageToImage")),
        ("tiny-sdxl-refiner", ()),  # an img2img checkpoint: its model index names the pipeline
    ],
)
def test_image_to_image_with_strength_through_the_official_client(
    tmp_path: Path, model: str, flags: tuple[str, ...]
) -> None:
    server = start_server(tmp_path, model, *flags, config=None)
    try:
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
    finally:
        stop_server(server)
