"""FLUX.2 [klein] with the official client against a real `diffbatch serve tiny-flux2-klein`
(step-level): text-to-image on `images.generate`, edits with one and three references sent
together on `images.edit` (several `image[]` parts), each the image the stock pipeline makes
for it alone, and one reference too many refused naming `image`."""

from __future__ import annotations

import base64
import io
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import openai
import pytest
from PIL import Image

from bench.launch import start_server, stop_server
from engine.request import GenerationRequest, RequestBatch, SamplingParams
from pipelines.base import PipelineConfig
from pipelines.registry import load_pipeline
from tests.media import picture

pytestmark = pytest.mark.slow


def encoded(image: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG")
    return buffer.getvalue()


def pixels(b64: str | None) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64 or ""))).convert("RGB"))


def test_text_to_image_and_multi_reference_edits(tmp_path: Path) -> None:
    references = [picture(64, 64 + 16 * i, seed=i) for i in range(5)]
    edits = [
        (references[:1], {"seed": 1, "num_inference_steps": 3}),
        (references[:3], {"seed": 2, "num_inference_steps": 4}),
    ]
    server = start_server(tmp_path, "tiny-flux2-klein", config=None)
    try:
        with openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0) as client:
            generated = client.images.generate(
                prompt="a lighthouse", size="64x48", extra_body={"seed": 5, "num_inference_steps": 2}
            )
            assert generated.data is not None and pixels(generated.data[0].b64_json).shape == (48, 64, 3)

            def edit(images: list[np.ndarray], body: dict[str, int]) -> np.ndarray:
                files = [(f"ref{i}.png", encoded(image), "image/png") for i, image in enumerate(images)]
                result = client.images.edit(
                    image=files, prompt="the cat wears the hat", size="64x48", extra_body=body
                )
                assert result.data is not None
                return pixels(result.data[0].b64_json)

            with ThreadPoolExecutor(2) as pool:
                served = list(pool.map(lambda args: edit(*args), edits))
            with pytest.raises(openai.BadRequestError) as too_many:
                edit(references, {"seed": 3})  # klein takes 4
            assert too_many.value.body["param"] == "image"  # type: ignore[index]
    finally:
        stop_server(server)

    pipeline = load_pipeline(PipelineConfig(model="tiny-flux2-klein", num_threads=1))
    for (images, body), got in zip(edits, served, strict=True):
        # The images as the server decoded them (PNG is lossless).
        params = SamplingParams(width=64, height=48, **body)  # type: ignore[arg-type]
        request = GenerationRequest.create("the cat wears the hat", params, input_images=tuple(images))
        (alone,) = pipeline.forward(
            RequestBatch(key=(), requests=(request.with_params(pipeline.resolve(request)),))
        )
        assert np.abs(got.astype(int) - alone.images[0].astype(int)).max() <= 1
