"""A real `diffbatch serve` of a class no family serves (tiny Sana), through the generic
adapter, driven by the official client: requests sent together share one forward and each
gets the image its stock diffusers call makes alone."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import DiffusionPipeline

from pipelines.tiny import tiny_model_dir
from tests.e2e.conftest import start_server, stop_server
from tests.e2e.sharing import sent_together
from tests.e2e.test_openai_client import client_for, pixels
from tests.pipelines.engines import difference
from tests.threads import THREADS

pytestmark = pytest.mark.slow

REQUESTS = [("a red cat", 1), ("a house on a hill", 2)]


def test_a_class_without_a_family_serves_batched_through_the_generic_adapter(tmp_path: Path) -> None:
    server = start_server(
        tmp_path,
        "tiny-sana",
        "--request-batch-max-wait-ms",
        "2000",
        "--num-threads",
        str(THREADS),
        config=None,
    )
    try:

        def generate(item: tuple[str, int]) -> np.ndarray:
            prompt, seed = item
            with client_for(server) as client:
                result = client.images.generate(
                    model="tiny-sana",
                    prompt=prompt,
                    size="64x64",
                    extra_body={"seed": seed, "num_inference_steps": 2},
                )
            return pixels((result.data or [])[0].b64_json)

        def send_both() -> list[np.ndarray]:
            with ThreadPoolExecutor(len(REQUESTS)) as pool:
                return list(pool.map(generate, REQUESTS))

        # Step mode (the default) falls back to request level; both share one forward (a
        # busy machine may part them: sent again, never passed).
        served = sent_together(server, send_both)
        log = server.log.read_text()
        assert "SanaPipeline has no family: served request-level by the generic adapter" in log
    finally:
        stop_server(server)
    pipe = DiffusionPipeline.from_pretrained(str(tiny_model_dir("tiny-sana")))
    for (prompt, seed), image in zip(REQUESTS, served, strict=True):
        expected = pipe(
            prompt=prompt,
            generator=torch.Generator("cpu").manual_seed(seed),
            num_inference_steps=2,
            height=64,
            width=64,
            output_type="np",
        ).images[0]
        assert difference(image, (np.clip(expected, 0, 1) * 255).round().astype(np.uint8)) <= 1


def test_a_class_that_cannot_run_here_stops_the_server_naming_it(tmp_path: Path) -> None:
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "KolorsPipeline"}))
    result = subprocess.run(
        [str(Path(sys.executable).parent / "diffbatch"), "serve", str(tmp_path), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 1
    assert "KolorsPipeline cannot be served here: it needs packages not installed here: sentencepiece" in (
        result.stderr
    )
