"""Memory schemes on the tiny families, in both batching modes: group offload to disk,
layerwise float8 casting and per-component dtypes. Each request's image is the same
batched as alone (within 1/255, the project's tolerance for a change of batch size on this
CPU), the step stages give the request-level forward's images, and each scheme's image is
within a stated tolerance of the plain model's."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from engine.request import GenerationRequest, RequestBatch, RequestOutput, SamplingParams
from pipelines.adapter import DiffusersAdapter
from pipelines.base import PipelineConfig
from pipelines.memory.options import MemoryConfig, Quantization
from pipelines.registry import load_pipeline
from server.composition import process_executor, thread_executor
from tests.pipelines.engines import difference
from tests.pipelines.test_stepping import packing_pair, run_interleaved
from tests.threads import THREADS

pytestmark = pytest.mark.slow

MODELS = ["tiny-sd", "tiny-flux", "tiny-qwen-image", "tiny-wan"]
LAYERWISE = Quantization("layerwise", "float8_e4m3fn")
# Largest difference from the plain model's image, in 8-bit levels. Offload moves weights
# and changes no arithmetic: exact. Float8 storage rounds every weight of the denoiser to
# 3 mantissa bits; on these random-weight models that moved images by 3 to 31 levels
# (measured: sd 8, flux 3, qwen-image 3, wan 31).
TOLERANCE = {"group": 0, "layerwise": 48}


def requests_for(pipeline: DiffusersAdapter) -> list[GenerationRequest]:
    """Three requests of one batch key: different prompts, seeds and n."""
    video = pipeline.modality == "video"
    params = SamplingParams(num_inference_steps=3, num_frames=9 if video else None)
    made = []
    for seed, (prompt, n) in enumerate([("a red cat", 1), ("a house on a hill", 2), ("the moon", 1)]):
        request = GenerationRequest.create(prompt, replace(params, seed=seed, n=n))
        made.append(request.with_params(pipeline.resolve(request)))
    return made


def images_of(outputs: list[RequestOutput]) -> list[np.ndarray]:
    return [np.asarray(image) for output in outputs for image in output.images]


_PLAIN: dict[str, list[np.ndarray]] = {}


def plain_images(model: str) -> list[np.ndarray]:
    if model not in _PLAIN:
        pipeline = load_pipeline(PipelineConfig(model=model, num_threads=THREADS))
        assert isinstance(pipeline, DiffusersAdapter)
        batch = requests_for(pipeline)
        _PLAIN[model] = images_of(pipeline.forward(RequestBatch(key=(), requests=tuple(batch))))
    return _PLAIN[model]


@pytest.fixture
def offload_dir(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "offload"


def memory_for(scheme: str, offload_dir: Path) -> MemoryConfig:
    if scheme == "group":
        return MemoryConfig(offload="group", offload_to_disk=str(offload_dir))
    return MemoryConfig(quantization=LAYERWISE)


@pytest.mark.parametrize("scheme", ["group", "layerwise"])
@pytest.mark.parametrize("model", MODELS)
def test_a_scheme_serves_each_request_as_alone_in_both_modes(
    model: str, scheme: str, offload_dir: Path
) -> None:
    pipeline = load_pipeline(
        PipelineConfig(model=model, num_threads=THREADS, memory=memory_for(scheme, offload_dir))
    )
    assert isinstance(pipeline, DiffusersAdapter)
    requests = requests_for(pipeline)
    batched = pipeline.forward(RequestBatch(key=(), requests=tuple(requests)))
    for request, together in zip(requests, batched, strict=True):
        (alone,) = pipeline.forward(RequestBatch(key=(), requests=(request,)))
        for mine, solo in zip(together.images, alone.images, strict=True):
            assert difference(mine, solo) <= 1, (model, scheme, "request-level batched vs alone")
    # Step-level: joining at different steps, each as the request-level forward made it.
    stepped = run_interleaved(pipeline, requests, [0, 1, 2])
    for together in batched:
        for mine, solo in zip(stepped[together.request_id].images, together.images, strict=True):
            assert difference(mine, solo) <= 1, (model, scheme, "stepped vs request-level")
    worst = max(difference(a, b) for a, b in zip(images_of(batched), plain_images(model), strict=True))
    assert worst <= TOLERANCE[scheme], (model, scheme, worst)
    if scheme == "group":
        # The blocks' weights live in files (diffusers leaves an untouched `empty_like` in each
        # tensor between calls: address space, not resident memory, until a block onloads).
        denoiser = getattr(pipeline.pipe, "transformer", None) or pipeline.pipe.unet
        on_disk = sum(f.stat().st_size for f in offload_dir.rglob("*.safetensors"))
        assert on_disk >= sum(p.numel() * p.element_size() for p in denoiser.parameters())
    else:
        denoiser = getattr(pipeline.pipe, "transformer", None) or pipeline.pipe.unet
        dtypes = {p.dtype for p in denoiser.parameters()}
        assert torch.float8_e4m3fn in dtypes


def test_per_component_dtypes_load_with_diffusers_and_cast_inputs() -> None:
    """Wan's VAE in float32 under a bfloat16 model, as Wan recommends; SD's VAE in bfloat16
    under float32 (its pipeline hands the VAE float32 latents: they are cast at the door)."""
    memory = MemoryConfig(component_dtypes=(("vae", "float32"),))
    wan = load_pipeline(
        PipelineConfig(model="tiny-wan", dtype="bfloat16", num_threads=THREADS, memory=memory)
    )
    assert isinstance(wan, DiffusersAdapter)
    assert wan.pipe.vae.dtype == torch.float32 and wan.pipe.transformer.dtype == torch.bfloat16
    sd = load_pipeline(
        PipelineConfig(
            model="tiny-sd", num_threads=THREADS, memory=MemoryConfig(component_dtypes=(("vae", "bfloat16"),))
        )
    )
    assert isinstance(sd, DiffusersAdapter)
    assert sd.pipe.vae.dtype == torch.bfloat16 and sd.pipe.unet.dtype == torch.float32
    for pipeline in (wan, sd):
        requests = requests_for(pipeline)
        batched = pipeline.forward(RequestBatch(key=(), requests=tuple(requests)))
        stepped = run_interleaved(pipeline, requests, [0, 0, 1])
        for output in batched:
            for mine, solo in zip(stepped[output.request_id].images, output.images, strict=True):
                # bfloat16 decodes of different batch sizes differ by a level or two.
                assert difference(mine, solo) <= 3


@pytest.mark.parametrize("model", ["tiny-flux", "tiny-flux2", "tiny-sd3"])
def test_a_denoiser_in_a_dtype_of_its_own_steps_sizes_packed_and_alone(model: str) -> None:
    """A bfloat16 transformer under a float32 model: its prediction comes back in bfloat16 and
    the scheduler hands its step back in that dtype, but the latents stay float32 (before,
    the float32 VAE got bfloat16 latents and raised). Two sizes packed in one forward (their
    inputs cast as the transformer's pre-hook casts them) against each alone."""
    memory = MemoryConfig(component_dtypes=(("transformer", "bfloat16"),))
    pipeline = load_pipeline(PipelineConfig(model=model, num_threads=THREADS, memory=memory))
    assert isinstance(pipeline, DiffusersAdapter)
    requests = packing_pair(pipeline)
    packed = run_interleaved(pipeline, requests, [0, 0])
    for request in requests:
        alone = run_interleaved(pipeline, [request], [0])[request.request_id]
        # Measured: both FLUX 0 of 255, tiny-sd3 7-9. SD3's packed forward gives exactly the
        # transformer's own output on the same inputs in bfloat16 too (checked step by step),
        # so the rest accrues outside the forward; where is not pinned down yet.
        assert difference(packed[request.request_id].images[0], alone.images[0]) <= 12


def test_an_unknown_component_is_named() -> None:
    memory = MemoryConfig(component_dtypes=(("vea", "float32"),))
    with pytest.raises(
        ValueError, match=r"--component-dtypes: the model has no component 'vea'; it has .*vae"
    ):
        load_pipeline(PipelineConfig(model="tiny-sd", memory=memory))


def test_an_unknown_component_is_refused_before_any_weight_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Checked against `model_index.json`: a typo costs no load of a large model first."""

    def load(*args: object, **kwargs: object) -> None:
        raise AssertionError("the weights were loaded before the flag was checked")

    monkeypatch.setattr("pipelines.loading.DiffusionPipeline.from_pretrained", load)
    memory = MemoryConfig(component_dtypes=(("vea", "float32"),))
    with pytest.raises(
        ValueError, match=r"--component-dtypes: the model has no component 'vea'; it has .*vae"
    ):
        load_pipeline(PipelineConfig(model="tiny-sd", memory=memory))


def test_model_offload_without_an_accelerator_is_refused_before_loading() -> None:
    memory = MemoryConfig(offload="model")
    with pytest.raises(ValueError, match="--offload: model offload moves weights"):
        load_pipeline(PipelineConfig(model="tiny-sd", memory=memory))
    if not torch.cuda.is_available():
        with pytest.raises(
            ValueError, match="--offload: model offload needs an accelerator; cuda is not available"
        ):
            load_pipeline(PipelineConfig(model="tiny-sd", device="cuda", memory=memory))


@pytest.fixture(scope="module")
def single_files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny-flux's transformer and tiny-sd's UNet, each as one safetensors file."""
    from diffusers import DiffusionPipeline
    from safetensors.torch import save_file

    from pipelines.loading import resolve_model_path

    directory = tmp_path_factory.mktemp("single")
    for model, component, name in (("tiny-flux", "transformer", "flux"), ("tiny-sd", "unet", "unet")):
        module = getattr(DiffusionPipeline.from_pretrained(resolve_model_path(model)), component)
        save_file(
            {k: v.contiguous() for k, v in module.state_dict().items()}, directory / f"{name}.safetensors"
        )
    return directory


def test_a_transformer_file_replaces_the_denoiser_and_one_of_another_architecture_is_named(
    single_files: Path,
) -> None:
    memory = MemoryConfig(transformer_file=str(single_files / "flux.safetensors"))
    pipeline = load_pipeline(PipelineConfig(model="tiny-flux", num_threads=THREADS, memory=memory))
    assert isinstance(pipeline, DiffusersAdapter)
    batch = requests_for(pipeline)
    images = images_of(pipeline.forward(RequestBatch(key=(), requests=tuple(batch))))
    assert all(difference(a, b) == 0 for a, b in zip(images, plain_images("tiny-flux"), strict=True))
    wrong = MemoryConfig(transformer_file=str(single_files / "unet.safetensors"))
    with pytest.raises(
        ValueError,
        match=r"--transformer-file: .*unet.safetensors does not load as this model's FluxTransformer2DModel",
    ):
        load_pipeline(PipelineConfig(model="tiny-flux", memory=wrong))


def test_with_model_offload_a_component_called_directly_offloads_the_others() -> None:
    """The step stages call the text encoder while the denoiser is still on the device (no
    `__call__` ends between steps to free it): each component's forward offloads the rest.
    Fakes stand in for accelerate's hooks (model offload needs an accelerator)."""
    from pipelines.memory.loading import one_component_resident

    class Hook:
        def __init__(self, model: torch.nn.Module) -> None:
            self.model, self.offloads = model, 0

        def offload(self) -> None:
            self.offloads += 1

    class Pipe:
        def __init__(self) -> None:
            self.text_encoder, self.unet = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
            self.components = {"text_encoder": self.text_encoder, "unet": self.unet, "tokenizer": object()}
            self._all_hooks = [Hook(self.text_encoder), Hook(self.unet)]

    pipe = Pipe()
    one_component_resident(pipe)
    pipe.text_encoder(torch.zeros(1, 2))
    assert [hook.offloads for hook in pipe._all_hooks] == [0, 1]
    pipe._all_hooks = [Hook(pipe.text_encoder), Hook(pipe.unet)]  # diffusers renews them per __call__
    pipe.unet(torch.zeros(1, 2))
    assert [hook.offloads for hook in pipe._all_hooks] == [1, 0]


@pytest.mark.parametrize(
    "memory, dtype",
    [
        (MemoryConfig(component_dtypes=(("vae", "float32"),)), "bfloat16"),
        (MemoryConfig(quantization=LAYERWISE), "float32"),
    ],
    ids=["component-dtypes", "layerwise"],
)
def test_an_image_to_image_pipe_shares_the_loaded_components_as_they_are(
    memory: MemoryConfig, dtype: str
) -> None:
    """img2img and inpainting run diffusers' own pipeline class over the text-to-image
    weights; diffusers' `from_pipe` ends with `.to(float32)`, which undid a bfloat16 model,
    its per-component dtypes and its float8 storage (and refuses torchao/GGUF models)."""
    pipeline = load_pipeline(
        PipelineConfig(
            model="tiny-sd",
            dtype=dtype,
            num_threads=THREADS,
            memory=memory,
            pipeline_class="pipelines.registry:StableDiffusionImageToImage",
        )
    )
    assert isinstance(pipeline, DiffusersAdapter)
    assert type(pipeline.pipe).__name__ == "StableDiffusionImg2ImgPipeline"
    unet_dtypes = {p.dtype for p in pipeline.pipe.unet.parameters()}
    if memory.quantization is None:
        assert unet_dtypes == {torch.bfloat16} and pipeline.pipe.vae.dtype == torch.float32
    else:
        assert torch.float8_e4m3fn in unet_dtypes


def test_each_load_offloads_to_disk_in_a_directory_of_its_own_removed_with_it(tmp_path: Path) -> None:
    """diffusers writes a block's file only where none exists yet: two loads on one
    `--offload-to-disk` path (a restart with other weights, two workers or replicas) read
    each other's weights. Each load writes in a fresh directory under the path instead."""
    import gc

    from diffusers import UNet2DConditionModel

    from pipelines.loading import resolve_model_path
    from pipelines.memory.loading import offload_groups

    class Pipe:
        def __init__(self, unet: Any) -> None:
            self.unet = unet
            self.components = {"unet": unet}

    def unet(scale: float) -> Any:
        module = UNet2DConditionModel.from_pretrained(resolve_model_path("tiny-sd"), subfolder="unet")
        with torch.no_grad():
            for parameter in module.parameters():
                parameter.mul_(scale)
        return module.eval()

    sample, t = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(0)), torch.tensor([10])
    context = torch.randn(1, 4, unet(1.0).config.cross_attention_dim)
    first, second = Pipe(unet(1.0)), Pipe(unet(0.5))
    with torch.no_grad():
        expected = second.unet(sample, t, context).sample
    offload_groups(first, torch.device("cpu"), str(tmp_path))
    offload_groups(second, torch.device("cpu"), str(tmp_path))
    with torch.no_grad():
        wrong = first.unet(sample, t, context).sample
        got = second.unet(sample, t, context).sample
    # Not torch.equal: the offloaded conv may pick another CPU kernel and differ in the last
    # bit (CI saw 3.6325e-02 vs 3.6326e-02). Reading the other load's weights (scale 1.0 for
    # 0.5) moves every value by far more than the tolerance, as `wrong` shows.
    assert torch.allclose(got, expected, rtol=0, atol=1e-5)
    assert not torch.allclose(wrong, expected, rtol=0, atol=1e-3)
    directories = [path for path in tmp_path.iterdir() if path.is_dir()]
    assert len(directories) == 2
    del first
    gc.collect()
    assert len([path for path in tmp_path.iterdir() if path.is_dir()]) == 1


@pytest.mark.parametrize("kind", ["thread", "process"])
async def test_an_engine_that_stops_removes_its_offload_files(tmp_path: Path, kind: str) -> None:
    """Removed when the executor shuts down (`Pipeline.close`), not left to exit handlers:
    a server stopped by SIGTERM ends by the signal, and runs none."""
    from engine.core.config import EngineConfig
    from engine.core.engine import AsyncEngine
    from engine.executor.abstract import Executor

    memory = MemoryConfig(offload="group", offload_to_disk=str(tmp_path))
    config = PipelineConfig(model="tiny-sd", num_threads=1, memory=memory)
    executor: Executor = thread_executor(config) if kind == "thread" else process_executor(config)
    engine = AsyncEngine(executor, EngineConfig(batching="step"))
    await engine.start()
    try:
        (directory,) = tmp_path.iterdir()
        assert directory.name.startswith("load-") and any(directory.rglob("*.safetensors"))
    finally:
        await engine.stop()
    assert list(tmp_path.iterdir()) == []
