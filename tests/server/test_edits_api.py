"""`/v1/images/edits` in process: uploads are checked, named, and nothing bad is queued."""

from __future__ import annotations

import asyncio
import base64
import io
import threading
from dataclasses import replace
from pathlib import Path
from typing import ClassVar

import httpx
import numpy as np
import pytest
from PIL import Image

from engine.core.engine import AsyncEngine
from engine.executor.thread_executor import ThreadExecutor
from engine.request import RequestBatch, RequestOutput
from pipelines.base import Modality
from server.app import create_app
from server.errors import APIError
from server.uploads import edit_mask
from tests.media import png
from tests.server.conftest import ClientFactory, ImageFakePipeline, settings_for, wait_ready

URL = "/v1/images/edits"


class FakeEditPipeline(ImageFakePipeline):
    """Returns the input image's mean colour at the asked size."""

    modality: ClassVar[Modality] = "edit"
    input_image_count: ClassVar[tuple[int, int]] = (1, 1)

    def forward(self, batch: RequestBatch) -> list[RequestOutput]:
        outputs = super().forward(batch)
        results = []
        for request, output in zip(batch.requests, outputs, strict=True):
            colour = request.input_images[0].reshape(-1, 3).mean(axis=0).astype(np.uint8)
            images = tuple(np.broadcast_to(colour, image.shape).copy() for image in output.images)
            results.append(replace(output, images=images))
        return results


async def edit_client(
    tmp_path: Path, pipeline: FakeEditPipeline, **settings: object
) -> tuple[httpx.AsyncClient, object]:
    config = settings_for(tmp_path, **settings)
    app = create_app(config, AsyncEngine(ThreadExecutor(lambda: pipeline), config.engine_config()))
    lifespan = app.router.lifespan_context(app)
    await lifespan.__aenter__()
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost")
    await wait_ready(client)
    return client, lifespan


@pytest.fixture
async def edits(tmp_path: Path):  # type: ignore[no-untyped-def]
    pipeline = FakeEditPipeline()
    client, lifespan = await edit_client(tmp_path, pipeline, max_upload_pixels=512 * 512)
    yield client, pipeline
    await client.aclose()
    await lifespan.__aexit__(None, None, None)  # type: ignore[attr-defined]


async def test_edit_returns_images_of_the_asked_size(
    edits: tuple[httpx.AsyncClient, FakeEditPipeline],
) -> None:
    client, _ = edits
    response = await client.post(
        URL,
        # A form's fields are strings, converted (JSON bodies are taken as typed).
        data={
            "prompt": "make it blue",
            "n": "2",
            "size": "64x32",
            "seed": "5",
            "priority": "1",
            "timeout": "60",
            "cache": '{"mode": "first-block", "threshold": 0.1}',
        },
        files={"image": ("a.png", png(40, 30), "image/png")},
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert [d["seed"] for d in body["data"]] == [5, 6] and body["size"] == "64x32"
    image = Image.open(io.BytesIO(base64.b64decode(body["data"][0]["b64_json"])))
    assert image.size == (64, 32) and image.getpixel((0, 0)) == (200, 10, 10)


async def test_an_edit_streams_image_edit_events(edits: tuple[httpx.AsyncClient, FakeEditPipeline]) -> None:
    client, _ = edits
    response = await client.post(
        URL,
        data={"prompt": "make it blue", "stream": "true", "size": "64x32"},
        files={"image": ("a.png", png(40, 30), "image/png")},
    )
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    assert [line for line in response.text.splitlines() if line.startswith("event: ")] == [
        "event: image_edit.completed"
    ]


@pytest.mark.parametrize(
    ("files", "data", "status", "param"),
    [
        ({}, {"prompt": "x"}, 400, "image"),
        ({"image": ("a.txt", b"not an image", "text/plain")}, {"prompt": "x"}, 400, "image"),
        ({"image": ("big.png", png(600, 600), "image/png")}, {"prompt": "x"}, 413, "image"),
        (
            {
                "image": ("a.png", png(40, 30), "image/png"),
                "mask": ("m.png", png(20, 20, mode="RGBA"), "image/png"),  # another size
            },
            {"prompt": "x"},
            400,
            "mask",
        ),
        (
            {
                "image": ("a.png", png(40, 30), "image/png"),
                "mask": ("m.png", png(40, 30, mode="L"), "image/png"),  # no alpha channel
            },
            {"prompt": "x"},
            400,
            "mask",
        ),
        (
            {
                "image": ("a.png", png(40, 30), "image/png"),
                "mask": ("m.png", png(40, 30, mode="RGBA"), "image/png"),  # this family takes none
            },
            {"prompt": "x"},
            400,
            "mask",
        ),
        ({"image": ("a.png", png(40, 30), "image/png")}, {"prompt": "x", "n": "0"}, 400, "n"),
        ({"image[]": ("a.png", png(40, 30), "image/png")}, {"prompt": ["a", "b"]}, 400, "prompt"),
    ],
)
async def test_bad_uploads_name_the_field_and_queue_nothing(
    edits: tuple[httpx.AsyncClient, FakeEditPipeline],
    files: dict[str, object],
    data: dict[str, object],
    status: int,
    param: str,
) -> None:
    client, pipeline = edits
    # With no file at all, the prompt travels as a multipart field so the body is still a form.
    if files:
        response = await client.post(URL, data=data, files=files)  # type: ignore[arg-type]
    else:
        response = await client.post(URL, files={"prompt": (None, "x")})
    assert response.status_code == status, response.text
    assert response.json()["error"]["param"] == param
    assert pipeline.forwards == []


async def test_two_images_for_a_one_image_model(edits: tuple[httpx.AsyncClient, FakeEditPipeline]) -> None:
    client, pipeline = edits
    files = [
        ("image[]", ("a.png", png(40, 30), "image/png")),
        ("image[]", ("b.png", png(40, 30), "image/png")),
    ]
    response = await client.post(URL, data={"prompt": "x"}, files=files)
    assert response.status_code == 400 and response.json()["error"]["param"] == "image"
    assert pipeline.forwards == []


async def test_edits_refused_by_a_text_to_image_model(make_client: ClientFactory) -> None:
    client = await make_client()
    response = await client.post(
        URL, data={"prompt": "x"}, files={"image": ("a.png", png(8, 8), "image/png")}
    )
    assert response.status_code == 400 and response.json()["error"]["code"] == "unsupported_model"


def _encoded(fmt: str, mode: str = "RGB") -> bytes:
    buffer = io.BytesIO()
    Image.new(mode, (16, 16)).save(buffer, format=fmt)
    return buffer.getvalue()


@pytest.mark.parametrize(
    ("content", "what"),
    [
        (_encoded("GIF"), "GIF"),
        (_encoded("TIFF"), "TIFF"),
        (_encoded("BMP"), "BMP"),
        (_encoded("ICO"), "ICO"),
        (_encoded("PNG", "I;16"), "16-bit PNG"),
        (b"\x89PNG\r\n\x1a\n" + b"\x00" * 40, "broken PNG"),
    ],
)
async def test_only_8_bit_png_jpeg_and_webp_are_read(
    edits: tuple[httpx.AsyncClient, FakeEditPipeline], content: bytes, what: str
) -> None:
    client, pipeline = edits
    response = await client.post(URL, data={"prompt": "x"}, files={"image": ("a.img", content, "image/png")})
    assert response.status_code == 400, what
    message = response.json()["error"]["message"]
    assert "8-bit PNG, JPEG or WebP" in message and "0x" not in message, message
    assert pipeline.forwards == []


async def test_input_images_beyond_the_queued_bytes_cap_get_429(tmp_path: Path) -> None:
    pipeline = FakeEditPipeline()
    pipeline.gate = threading.Event()
    # 40x30 RGB uploads hold 3,600 bytes each: two fit under 8 KiB, a third does not.
    client, lifespan = await edit_client(tmp_path, pipeline, max_queued_input_mb=8 / 1024)
    try:
        upload = {"image": ("a.png", png(40, 30), "image/png")}
        held = [
            asyncio.create_task(client.post(URL, data={"prompt": f"p{i}"}, files=upload)) for i in range(2)
        ]
        for _ in range(500):
            if (await client.get("/metrics")).text.count("diffbatch_queued_input_bytes 7200.0"):
                break
            await asyncio.sleep(0.01)
        refused = await client.post(URL, data={"prompt": "third"}, files=upload)
        assert refused.status_code == 429 and "Retry-After" in refused.headers
        assert "input images" in refused.json()["error"]["message"]
        pipeline.gate.set()
        assert [r.status_code for r in await asyncio.gather(*held)] == [200, 200]
    finally:
        pipeline.gate.set()
        await client.aclose()
        await lifespan.__aexit__(None, None, None)  # type: ignore[attr-defined]


@pytest.mark.parametrize("mode", ["RGBA", "LA", "P"])
def test_a_mask_is_read_as_openai_means_it(mode: str) -> None:
    """Fully transparent pixels are the area to edit: 255 for diffusers; the rest 0."""
    alpha = np.full((4, 6), 255, np.uint8)
    alpha[1:3, 2:5] = 0
    alpha[0, 0] = 128  # half transparent: kept (OpenAI edits only fully transparent pixels)
    image = Image.fromarray(np.dstack([np.full((4, 6, 3), 90, np.uint8), alpha]), "RGBA")
    if mode == "LA":
        image = image.convert("LA")
    elif mode == "P":
        image = Image.fromarray(np.where(alpha == 0, 0, 1).astype(np.uint8), "P")
        image.info["transparency"] = 0
    expected = np.where(alpha == 0, 255, 0)
    assert np.array_equal(edit_mask(image), expected)


def test_a_mask_without_alpha_is_refused_by_name() -> None:
    with pytest.raises(APIError) as raised:
        edit_mask(Image.new("L", (4, 4), 255))
    assert raised.value.status == 400 and raised.value.param == "mask"
