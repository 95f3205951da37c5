"""`images.edit` with the official client against a real `diffbatch serve tiny-qwen-image-edit`."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import openai
import pytest
from PIL import Image

from bench.launch import start_server, stop_server
from tests.media import png

pytestmark = pytest.mark.slow


def test_edit_with_the_official_client(tmp_path: Path) -> None:
    server = start_server(tmp_path, "tiny-qwen-image-edit", config=None)
    try:
        client = openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0)
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
