"""torchao int8 weight-only (`--quantization torchao:int8wo`) on the tiny families, in both
batching modes: each request's image is the same batched as alone (within 1/255, the
project's tolerance for a change of batch size on this CPU), the step stages give the
request-level forward's images, and each image is within a measured tolerance of the plain
model's. Needs the `torchao` package (the [torchao] extra, which the `test` extra includes)."""

from __future__ import annotations

import pytest
import torchao  # noqa: F401  (a missing package fails here, never skips)

from engine.request import RequestBatch
from pipelines.adapter import DiffusersAdapter
from pipelines.base import PipelineConfig
from pipelines.memory.options import MemoryConfig, Quantization
from pipelines.registry import load_pipeline
from tests.pipelines.engines import difference
from tests.pipelines.test_memory import images_of, plain_images, requests_for
from tests.pipelines.test_stepping import run_interleaved
from tests.threads import THREADS

pytestmark = pytest.mark.slow

INT8 = Quantization("torchao", "int8wo")
# Largest difference from the plain model's image, in 8-bit levels. Int8 weight-only keeps
# one scale per output channel, far finer than float8's 3 mantissa bits; on these
# random-weight models it moved images by (measured) sd 1, flux 1, qwen-image 1, wan 22
# (Wan's video VAE amplifies small latent differences, float8 moved it most too, and since
# tiny-wan v2 its cross-attention and output weights are scaled up: `pipelines/tiny/gains.py`).
TOLERANCE = {"tiny-sd": 2, "tiny-flux": 2, "tiny-qwen-image": 2, "tiny-wan": 28}


@pytest.mark.parametrize("model", list(TOLERANCE))
def test_int8_weight_only_serves_each_request_as_alone_in_both_modes(model: str) -> None:
    from torchao.quantization import Int8Tensor

    pipeline = load_pipeline(
        PipelineConfig(model=model, num_threads=THREADS, memory=MemoryConfig(quantization=INT8))
    )
    assert isinstance(pipeline, DiffusersAdapter)
    denoiser = getattr(pipeline.pipe, "transformer", None) or pipeline.pipe.unet
    assert any(isinstance(p.data, Int8Tensor) for p in denoiser.parameters()), "not quantized"
    requests = requests_for(pipeline)
    batched = pipeline.forward(RequestBatch(key=(), requests=tuple(requests)))
    for request, together in zip(requests, batched, strict=True):
        (alone,) = pipeline.forward(RequestBatch(key=(), requests=(request,)))
        for mine, solo in zip(together.images, alone.images, strict=True):
            assert difference(mine, solo) <= 1, (model, "request-level batched vs alone")
    # Step-level: joining at different steps, each as the request-level forward made it.
    stepped = run_interleaved(pipeline, requests, [0, 1, 2])
    for together in batched:
        for mine, solo in zip(stepped[together.request_id].images, together.images, strict=True):
            assert difference(mine, solo) <= 1, (model, "stepped vs request-level")
    worst = max(difference(a, b) for a, b in zip(images_of(batched), plain_images(model), strict=True))
    assert worst <= TOLERANCE[model], (model, worst)


def test_a_pipeline_built_in_memory_is_quantized_in_place() -> None:
    """The benchmarks' random-weight models are built, not loaded with `from_pretrained`:
    `quantize_built` gives their denoiser the same int8 weights (and nothing else), and
    their bytes are counted as stored (torchao's tensors have no data pointer of their own:
    counting them stopped `diffbatch serve --quantization torchao:int8wo` at start)."""
    from torchao.quantization import Int8Tensor

    from pipelines.memory.footprint import weight_bytes
    from pipelines.memory.quantization import quantize_built

    pipeline = load_pipeline(PipelineConfig(model="tiny-sd", num_threads=THREADS))
    assert isinstance(pipeline, DiffusersAdapter)
    quantize_built(pipeline.pipe, MemoryConfig())
    assert not any(isinstance(p.data, Int8Tensor) for p in pipeline.pipe.unet.parameters())
    plain = weight_bytes(pipeline)
    quantize_built(pipeline.pipe, MemoryConfig(quantization=INT8))
    assert any(isinstance(p.data, Int8Tensor) for p in pipeline.pipe.unet.parameters())
    assert not any(isinstance(p.data, Int8Tensor) for p in pipeline.pipe.text_encoder.parameters())
    # The unet's linear weights went from 4 bytes to 1 (plus a scale per output channel).
    assert 0 < weight_bytes(pipeline) < plain


def test_an_image_to_image_model_keeps_its_int8_weights() -> None:
    """diffusers' `from_pipe` ended with `.to(float32)`, which torchao refuses ("Casting a
    quantized model to a new dtype is unsupported"): img2img and inpainting did not load."""
    from torchao.quantization import Int8Tensor

    pipeline = load_pipeline(
        PipelineConfig(
            model="tiny-sd",
            num_threads=THREADS,
            memory=MemoryConfig(quantization=INT8),
            pipeline_class="pipelines.registry:StableDiffusionImageToImage",
        )
    )
    assert isinstance(pipeline, DiffusersAdapter)
    assert any(isinstance(p.data, Int8Tensor) for p in pipeline.pipe.unet.parameters())
