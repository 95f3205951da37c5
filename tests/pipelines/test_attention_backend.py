"""`--attention-backend` through diffusers' attention dispatcher, on the tiny models: a
backend the CPU runs (math: SDPA's reference kernel) serves a DiT with the images of the
default; a UNet, whose attention does not go through the dispatcher, and a CUDA backend on
the CPU are refused when the model loads, naming the flag."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

from engine.request import RequestBatch
from pipelines.adapter import DiffusersAdapter
from pipelines.base import PipelineConfig
from pipelines.denoiser.options import DenoiserConfig, DenoiserSettingError
from pipelines.registry import load_pipeline
from tests.pipelines.engines import difference
from tests.pipelines.test_stepping import mixed_requests
from tests.threads import THREADS

pytestmark = pytest.mark.slow


def loaded(model: str, denoiser: DenoiserConfig | None = None) -> DiffusersAdapter:
    pipeline = load_pipeline(
        PipelineConfig(model=model, num_threads=THREADS, denoiser=denoiser or DenoiserConfig())
    )
    assert isinstance(pipeline, DiffusersAdapter)
    return pipeline


@pytest.fixture(autouse=True)
def native_afterwards() -> Iterator[None]:
    """Setting a backend also makes it diffusers' process-wide default: restore it."""
    yield
    _AttentionBackendRegistry.set_active_backend(AttentionBackendName.NATIVE)


def test_math_attention_serves_a_dit_with_the_default_images() -> None:
    native = loaded("tiny-flux")
    math = loaded("tiny-flux", DenoiserConfig(attention_backend="math"))
    backends = {p._attention_backend for p in math.pipe.transformer.attn_processors.values()}
    assert backends == {AttentionBackendName._NATIVE_MATH}
    (request, *_) = mixed_requests(native, random.Random(0))
    (got,) = math.forward(RequestBatch(key=(), requests=(request,)))
    (want,) = native.forward(RequestBatch(key=(), requests=(request,)))
    assert difference(got.images[0], want.images[0]) <= 1


@pytest.mark.parametrize(
    ("model", "backend", "device", "message"),
    [
        ("tiny-sd", "math", "cpu", r"--attention-backend: UNet2DConditionModel \(unet\) does not compute"),
        ("tiny-flux", "flash", "cpu", r"--attention-backend: flash runs on CUDA only; --device is cpu"),
    ],
)
def test_what_the_model_or_device_cannot_run_is_refused_at_load(
    model: str, backend: str, device: str, message: str
) -> None:
    config = PipelineConfig(model=model, device=device, denoiser=DenoiserConfig(attention_backend=backend))
    with pytest.raises(DenoiserSettingError, match=message):
        load_pipeline(config)
