"""Qwen-Image 2.1 with the official client against a real `diffbatch serve tiny-qwen-image-21`
(step-level): requests that share denoiser forwards each get the image diffusers' own call makes alone, as
RGBA PNGs (JPEG: RGB); edits with one and three references (several `image[]` parts) on
`images.edit`, each as the stock call makes it alone, and a fourth reference refused naming
`image`."""

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
from engine.request import GenerationRequest, SamplingParams
from pipelines.adapter import DiffusersAdapter
from pipelines.base import PipelineConfig
from pipelines.family_options import FamilyOptions
from pipelines.registry import load_pipeline
from tests.e2e.sharing import sent_together
from tests.media import picture
from tests.pipelines.stock import stock_output
from tests.threads import THREADS

pytestmark = pytest.mark.slow

MODEL = "tiny-qwen-image-21"
REQUESTS: list[tuple[str, dict[str, object]]] = [
    ("a red cat", {"seed": 1, "num_inference_steps": 3}),
    ("a blue dog", {"seed": 2, "num_inference_steps": 4}),
    (
        "a lighthouse at night, oil",
        {"seed": 3, "num_inference_steps": 3, "negative_prompt": "blur", "true_cfg_scale": 3.0},
    ),
]


def decoded(b64: str | None) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(b64 or "")))


def test_generations_step_together_as_rgba_images_each_as_alone(tmp_path: Path) -> None:
    server = start_server(tmp_path, MODEL, "--batching", "step", config=None, ready_timeout_s=300)
    try:
        with openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=600) as client:

            def generate(prompt: str, body: dict[str, object]) -> Image.Image:
                result = client.images.generate(prompt=prompt, size="64x64", extra_body=body)
                assert result.data is not None
                return decoded(result.data[0].b64_json)

            def send() -> list[Image.Image]:
                with ThreadPoolExecutor(3) as pool:
                    return list(pool.map(lambda r: generate(*r), REQUESTS))

            served = sent_together(server, send)
            jpeg = client.images.generate(
                prompt="a red cat", size="64x64", output_format="jpeg", extra_body=REQUESTS[0][1]
            )
            assert jpeg.data is not None and decoded(jpeg.data[0].b64_json).mode == "RGB"
        assert "step-level batching" in server.log.read_text()
    finally:
        stop_server(server)

    pipeline = load_pipeline(PipelineConfig(model=MODEL, num_threads=THREADS))
    assert isinstance(pipeline, DiffusersAdapter)
    for (prompt, body), image in zip(REQUESTS, served, strict=True):
        assert image.mode == "RGBA" and image.size == (64, 64)
        request = GenerationRequest.create(prompt, SamplingParams(width=64, height=64, **body))  # type: ignore[arg-type]
        alone = stock_output(pipeline, request.with_params(pipeline.resolve(request)))
        assert np.abs(np.asarray(image).astype(int) - alone.images[0].astype(int)).max() <= 1


def encoded(image: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG")
    return buffer.getvalue()


def test_edits_with_one_and_three_references_each_as_alone(tmp_path: Path) -> None:
    references = [picture(64, 64 + 32 * i, seed=i) for i in range(4)]
    edits = [
        (references[:1], {"seed": 1, "num_inference_steps": 3}),
        (references[:3], {"seed": 2, "num_inference_steps": 2}),
    ]
    args = ("--batching", "step", "--reference-resolution", "64")
    server = start_server(tmp_path, MODEL, *args, config=None, ready_timeout_s=300)
    try:
        with openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=600) as client:

            def edit(images: list[np.ndarray], body: dict[str, object]) -> Image.Image:
                files = [(f"ref{i}.png", encoded(image), "image/png") for i, image in enumerate(images)]
                result = client.images.edit(
                    image=files, prompt="the cat wears the hat", size="64x64", extra_body=body
                )
                assert result.data is not None
                return decoded(result.data[0].b64_json)

            with ThreadPoolExecutor(2) as pool:
                served = list(pool.map(lambda args: edit(*args), edits))
            with pytest.raises(openai.BadRequestError) as too_many:
                edit(references, {"seed": 3})
            assert too_many.value.body["param"] == "image"  # type: ignore[index]
    finally:
        stop_server(server)

    options = FamilyOptions(reference_resolution=64)
    pipeline = load_pipeline(PipelineConfig(model=MODEL, num_threads=THREADS, options=options))
    assert isinstance(pipeline, DiffusersAdapter)
    for (images, body), image in zip(edits, served, strict=True):
        params = SamplingParams(width=64, height=64, **body)  # type: ignore[arg-type]
        request = GenerationRequest.create("the cat wears the hat", params, input_images=tuple(images))
        alone = stock_output(pipeline, request.with_params(pipeline.resolve(request)))
        assert np.abs(np.asarray(image).astype(int) - alone.images[0].astype(int)).max() <= 1
