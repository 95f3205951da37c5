"""A GGUF transformer file (`--transformer-file model.gguf`), built offline by the test from
tiny-flux's own transformer with Q8_0 weights: served in both batching modes, each request
as alone, its images near the unquantized ones. Needs the `gguf` package (the [gguf]
extra, which the `test` extra includes)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from engine.request import RequestBatch
from pipelines.adapter import DiffusersAdapter
from pipelines.base import PipelineConfig
from pipelines.memory.options import MemoryConfig
from pipelines.registry import load_pipeline
from tests.pipelines.engines import difference
from tests.pipelines.test_memory import images_of, plain_images, requests_for
from tests.pipelines.test_stepping import run_interleaved
from tests.threads import THREADS

pytestmark = pytest.mark.slow

# Q8_0 keeps 8 bits per weight in blocks of 32 with one scale each; on tiny-flux's random
# weights the images moved by 1 level (measured 2026-12-02); the bound leaves room for other
# CPUs' kernels, as test_torchao's do.
TOLERANCE = 2


@pytest.fixture(scope="module")
def flux_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from diffusers import DiffusionPipeline

    from pipelines.loading import resolve_model_path

    transformer = DiffusionPipeline.from_pretrained(resolve_model_path("tiny-flux")).transformer
    path = tmp_path_factory.mktemp("gguf") / "tiny-flux-Q8_0.gguf"
    writer = gguf.GGUFWriter(str(path), arch="flux")
    for name, tensor in transformer.state_dict().items():
        data = tensor.float().numpy()
        if data.ndim == 2 and data.shape[-1] % 32 == 0:  # Q8_0 blocks are 32 wide
            quantized = gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(name, quantized, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(name, data.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_gguf_transformer_serves_each_request_as_alone_in_both_modes(flux_gguf: Path) -> None:
    memory = MemoryConfig(transformer_file=str(flux_gguf))
    pipeline = load_pipeline(PipelineConfig(model="tiny-flux", num_threads=THREADS, memory=memory))
    assert isinstance(pipeline, DiffusersAdapter)
    assert any(type(p).__name__ == "GGUFParameter" for p in pipeline.pipe.transformer.parameters())
    requests = requests_for(pipeline)
    batched = pipeline.forward(RequestBatch(key=(), requests=tuple(requests)))
    for request, together in zip(requests, batched, strict=True):
        (alone,) = pipeline.forward(RequestBatch(key=(), requests=(request,)))
        assert all(difference(a, b) <= 1 for a, b in zip(together.images, alone.images, strict=True))
    stepped = run_interleaved(pipeline, requests, [0, 1, 2])
    for together in batched:
        pairs = zip(stepped[together.request_id].images, together.images, strict=True)
        assert all(difference(a, b) <= 1 for a, b in pairs)
    worst = max(difference(a, b) for a, b in zip(images_of(batched), plain_images("tiny-flux"), strict=True))
    assert worst <= TOLERANCE, worst


def test_a_gguf_file_of_another_architecture_is_named(tmp_path: Path, flux_gguf: Path) -> None:
    memory = MemoryConfig(transformer_file=str(flux_gguf))
    with pytest.raises(ValueError, match=r"--transformer-file: .* does not load as this model's"):
        load_pipeline(PipelineConfig(model="tiny-sd3", memory=memory))
