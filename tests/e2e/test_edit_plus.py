"""Multi-image edits with the official client against a real `diffbatch serve
tiny-qwen-image-edit-2511` (QwenImageEditPlusPipeline, step-level): requests with one, two
and three images in one server, each the image the stock diffusers call makes for it alone;
a fourth image is a 400 naming `image`. At diffusers' own ~1024x1024 pixels a reference costs
the tiny model seconds of VAE and 4096 of the denoiser's tokens, so the server
(`bench.small_references:QwenImageEditPlusSmall`) and the stock call here both send them to
the VAE at 64x64: the same code with a smaller number (`pipelines.qwen_edit_plus` reads
diffusers' area at each call)."""

from __future__ import annotations

import base64
import io
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import openai
import pytest
from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as edit_plus
from PIL import Image

from bench.launch import start_server, stop_server
from bench.small_references import REFERENCE_AREA
from engine.request import GenerationRequest, SamplingParams
from pipelines.adapter import DiffusersAdapter
from pipelines.base import PipelineConfig
from pipelines.registry import load_pipeline
from tests.e2e.test_edits import encoded
from tests.media import picture
from tests.pipelines.stock import stock_output
from tests.threads import THREADS

pytestmark = pytest.mark.slow

MODEL = "tiny-qwen-image-edit-2511"
# Three requests, with one, two and three pictures (of different aspect ratios).
PICTURES = [
    (picture(48, 32, 1),),
    (picture(40, 40, 2), picture(32, 48, 3)),
    (picture(48, 32, 4), picture(40, 40, 5), picture(32, 48, 6)),
]
BODIES: list[dict[str, object]] = [
    {"seed": 1, "num_inference_steps": 2},
    {"seed": 2, "num_inference_steps": 3, "negative_prompt": "blurry", "true_cfg_scale": 2.0},
    {"seed": 3, "num_inference_steps": 2},
]


def test_one_two_and_three_images_each_as_the_stock_call_makes_it_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    small = ("--pipeline-class", "bench.small_references:QwenImageEditPlusSmall")
    server = start_server(tmp_path, MODEL, "--batching", "step", *small, config=None, ready_timeout_s=300)
    try:
        with openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=600) as client:

            def edit(pictures: tuple[np.ndarray, ...], body: dict[str, object]) -> np.ndarray:
                result = client.images.edit(
                    image=[(f"p{i}.png", encoded(p), "image/png") for i, p in enumerate(pictures)],
                    prompt="put them together",
                    size="64x64",
                    extra_body=body,
                )
                assert result.data is not None
                data = base64.b64decode(result.data[0].b64_json or "")
                return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))

            with ThreadPoolExecutor(3) as pool:
                served = list(pool.map(edit, PICTURES, BODIES))
            with pytest.raises(openai.BadRequestError) as too_many:
                edit((*PICTURES[2], picture(40, 40, 7)), BODIES[0])
            assert too_many.value.body["param"] == "image"  # type: ignore[index]
            assert "1 to 3 input images, got 4" in too_many.value.message
        assert "step-level batching" in server.log.read_text()
    finally:
        stop_server(server)

    monkeypatch.setattr(edit_plus, "VAE_IMAGE_SIZE", REFERENCE_AREA)
    pipeline = load_pipeline(PipelineConfig(model=MODEL, num_threads=THREADS))
    assert isinstance(pipeline, DiffusersAdapter)
    for pictures, body, got in zip(PICTURES, BODIES, served, strict=True):
        params = SamplingParams(width=64, height=64, **body)  # type: ignore[arg-type]
        request = GenerationRequest.create("put them together", params, input_images=pictures)
        alone = stock_output(pipeline, request.with_params(pipeline.resolve(request)))
        assert np.abs(got.astype(int) - alone.images[0].astype(int)).max() <= 1
