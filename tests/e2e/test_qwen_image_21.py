"""Qwen-Image 2.1 with the official client against a real `diffbatch serve tiny-qwen-image-21`
(step-level): requests that step together each get the image the stock call makes alone, as
RGBA PNGs (JPEG: RGB)."""

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

            with ThreadPoolExecutor(3) as pool:
                served = list(pool.map(lambda r: generate(*r), REQUESTS))
            jpeg = client.images.generate(
                prompt="a red cat", size="64x64", output_format="jpeg", extra_body=REQUESTS[0][1]
            )
            assert jpeg.data is not None and decoded(jpeg.data[0].b64_json).mode == "RGB"
        assert "step-level batching" in server.log.read_text()
    finally:
        stop_server(server)

    pipeline = load_pipeline(PipelineConfig(model=MODEL, num_threads=2))
    for (prompt, body), image in zip(REQUESTS, served, strict=True):
        assert image.mode == "RGBA" and image.size == (64, 64)
        request = GenerationRequest.create(prompt, SamplingParams(width=64, height=64, **body))  # type: ignore[arg-type]
        request = request.with_params(pipeline.resolve(request))
        (alone,) = pipeline.forward(RequestBatch(key=(), requests=(request,)))
        assert np.abs(np.asarray(image).astype(int) - alone.images[0].astype(int)).max() <= 1
