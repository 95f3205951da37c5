"""LoRA adapters per request, on the tiny models with their tiny LoRAs: requests with
different adapters (and none) sent together each get their solo image, in separate forwards
(request-level) or step groups (step-level); adapters change the image; `max_loras 1`
still serves alternating adapters correctly; bad adapters fail at start or at first use
without harming other requests. The edit families (FLUX.1-Kontext, FLUX.1 Fill, an
image-to-image pipeline) too, their requests carrying an input image (and a mask)."""

from __future__ import annotations

import asyncio
import hashlib
from dataclasses import replace
from pathlib import Path
from typing import Literal

import numpy as np
import pytest

from engine.core.config import EngineConfig
from engine.core.engine import AsyncEngine
from engine.executor.thread_executor import ThreadExecutor
from engine.outputs import DecodeRecord, ForwardRecord, ModerationRecord
from engine.request import GenerationRequest, LoraRef, RequestBatch, SamplingParams
from engine.timeline import RequestTimeline
from pipelines.base import Pipeline, PipelineConfig
from pipelines.lora import LoraLoadError
from pipelines.registry import load_pipeline
from pipelines.tiny.lora import WEIGHTS, tiny_lora_dir
from tests.media import picture
from tests.pipelines.edit_families import IMAGE_TO_IMAGE
from tests.pipelines.engines import difference
from tests.pipelines.test_flux_kontext_fill import box
from tests.threads import THREADS

pytestmark = pytest.mark.slow

ADAPTERS = (("a", "tiny-lora-1"), ("b", "tiny-lora-2"))
# Request-level batching calls diffusers' own pipeline, the same way for every family; the
# step-level stages are ours, per family.
CASES = [
    ("tiny-sd", "request"),
    ("tiny-sd", "step"),
    ("tiny-sdxl", "step"),
    ("tiny-flux", "step"),
    ("tiny-qwen-image", "step"),
    ("tiny-qwen-image-21", "step"),
    ("tiny-z-image", "step"),
    ("tiny-chroma", "step"),
    ("tiny-flux2", "step"),
    ("tiny-flux2-klein", "step"),  # true CFG: the adapter on the negative rows too
]
# Families whose requests carry an input image, by served name: (config, with an inpainting
# mask). Each request gets a picture of its own, of one size (Kontext's reference layout).
EDITS = {
    "flux-kontext": (PipelineConfig(model="tiny-flux-kontext", num_threads=THREADS), False),
    "flux-fill": (PipelineConfig(model="tiny-flux-fill", num_threads=THREADS), True),
    "z-image-img2img": (IMAGE_TO_IMAGE["z-image-img2img"], False),
}


def config(model: str, max_loras: int = 4) -> PipelineConfig:
    served = EDITS[model][0] if model in EDITS else PipelineConfig(model=model, num_threads=THREADS)
    return replace(served, lora_modules=ADAPTERS, max_loras=max_loras)


def request(
    seed: int, adapter: str | None, scale: float = 1.0, steps: int = 4, model: str = ""
) -> GenerationRequest:
    """A text-to-image request, or an edit when `model` names one of EDITS."""
    lora = None if adapter is None else LoraRef(adapter, scale)
    params = SamplingParams(seed=seed, num_inference_steps=steps, lora=lora)
    if model not in EDITS:
        return GenerationRequest.create(f"a lighthouse {seed}", params)
    params = replace(params, width=64, height=48)
    mask = box(seed % 4) if EDITS[model][1] else None
    return GenerationRequest.create(
        f"a lighthouse {seed}", params, input_images=(picture(64, 48, seed),), mask=mask
    )


def solo(pipeline: Pipeline, sent: GenerationRequest) -> np.ndarray:
    alone = sent.with_params(pipeline.resolve(sent))
    (output,) = pipeline.forward(RequestBatch(pipeline.batch_key(alone), (alone,)))
    image: np.ndarray = output.images[0]
    return image


class Forwards:
    """Observer keeping each forward's record."""

    def __init__(self) -> None:
        self.records: list[ForwardRecord] = []

    def on_batch_start(self, batch: RequestBatch, now: float) -> None: ...

    def on_forward(self, record: ForwardRecord) -> None:
        self.records.append(record)

    def on_decode(self, record: DecodeRecord) -> None: ...

    def on_moderation(self, record: ModerationRecord) -> None: ...

    def on_abort(self, request_id: str) -> None: ...

    def on_progress(self, request_ids: list[str], done: int, total: int) -> None: ...

    def on_request_end(
        self, request: GenerationRequest, timeline: RequestTimeline, error: Exception | None
    ) -> None: ...


async def serve_together(
    pipeline: Pipeline, requests: list[GenerationRequest], batching: Literal["request", "step"]
) -> tuple[list[np.ndarray], list[ForwardRecord]]:
    engine = AsyncEngine(
        ThreadExecutor(lambda: pipeline),
        EngineConfig(max_num_seqs=8, request_batch_max_wait_ms=5000, batching=batching),
    )
    forwards = Forwards()
    engine.observers.append(forwards)
    await engine.start()
    try:
        outputs = await asyncio.gather(*(engine.generate(r) for r in requests))
    finally:
        await engine.stop()
    return [output.images[0] for output in outputs], forwards.records


@pytest.mark.parametrize(("model", "batching"), [*CASES, *((family, "step") for family in EDITS)])
async def test_each_adapter_gets_its_solo_image_in_forwards_of_its_own(
    model: str, batching: Literal["request", "step"]
) -> None:
    def sent(seed: int, adapter: str | None, scale: float = 1.0) -> GenerationRequest:
        return request(seed, adapter, scale, model=model)

    pipeline = load_pipeline(config(model))
    requests = [sent(1, "a"), sent(2, "b"), sent(3, None), sent(4, "a"), sent(5, "b", 0.5)]
    images, forwards = await serve_together(pipeline, requests, batching)

    # One adapter (at one scale) per forward; "a" twice shares its forwards.
    assert {record.adapter for record in forwards} == {"a", "b", None}
    if batching == "request":
        assert sorted((r.adapter or "", r.num_requests) for r in forwards) == [
            ("", 1),
            ("a", 2),
            ("b", 1),
            ("b", 1),
        ]
    else:
        assert max(r.num_requests for r in forwards if r.adapter == "a") == 2
    fresh = load_pipeline(config(model))  # no adapter loaded before these solo runs
    for one, image in zip(requests, images, strict=True):
        assert difference(image, solo(fresh, one)) <= 1
    base = solo(fresh, sent(1, None))
    assert difference(solo(fresh, sent(1, "a")), base) > 10
    assert difference(solo(fresh, sent(1, "b")), base) > 10
    assert difference(solo(fresh, sent(1, "a")), solo(fresh, sent(1, "b"))) > 10


@pytest.mark.parametrize("model", ["tiny-flux", "tiny-z-image", "tiny-sd3"])
async def test_requests_of_three_sizes_under_one_adapter_share_forwards_and_get_their_solo_images(
    model: str,
) -> None:
    """The step matrix's LoRA column for mixed sizes (issue 42): 32, 48 and 64 px under
    adapter "a" step in one forward (the adapter is in the step key, the size is not), one
    without an adapter in forwards of its own, and each image is its image alone."""
    pipeline = load_pipeline(config(model))

    def sent(seed: int, side: int, adapter: str | None) -> GenerationRequest:
        sized = request(seed, adapter)
        return sized.with_params(replace(sized.params, width=side, height=side))

    requests = [sent(1, 32, "a"), sent(2, 48, "a"), sent(3, 64, "a"), sent(4, 48, None)]
    images, forwards = await serve_together(pipeline, requests, "step")
    assert max(r.num_requests for r in forwards if r.adapter == "a") == 3
    assert {r.num_requests for r in forwards if r.adapter is None} == {1}
    fresh = load_pipeline(config(model))
    for one, image in zip(requests, images, strict=True):
        assert image.shape[:2] == (one.params.height, one.params.width)
        assert difference(image, solo(fresh, one)) <= 1


# Wan 2.2: the adapter goes into both experts (`tests/pipelines/test_wan22_lora.py`).
@pytest.mark.parametrize("model", ["tiny-sd3", "tiny-wan", "tiny-ltx", "tiny-wan22"])
def test_the_other_families_apply_and_drop_their_tiny_lora(model: str) -> None:
    pipeline = load_pipeline(replace(config(model), lora_modules=ADAPTERS[:1]))
    sent = replace(request(1, None, steps=2), prompt="a boat")
    base = solo(pipeline, sent)
    with_adapter = solo(pipeline, sent.with_params(replace(sent.params, lora=LoraRef("a"))))
    assert difference(with_adapter, base) > 10
    assert difference(solo(pipeline, sent), base) == 0


def test_one_loaded_adapter_at_a_time_still_serves_alternating_adapters() -> None:
    reference = load_pipeline(config("tiny-sd"))
    one = load_pipeline(config("tiny-sd", max_loras=1))
    loras = one.loras  # type: ignore[attr-defined]
    for adapter in ["a", "b", None, "a", "b", "b", "a"]:
        sent = request(7, adapter)
        assert difference(solo(one, sent), solo(reference, sent)) <= 1
        assert len(loras.loaded) <= 1
    assert list(loras.loaded) == ["a"]


def test_scale_is_part_of_the_key_and_changes_the_image() -> None:
    pipeline = load_pipeline(config("tiny-sd"))
    half, full = request(1, "a", 0.5), request(1, "a", 1.0)
    keys = {pipeline.batch_key(r.with_params(pipeline.resolve(r))) for r in (half, full)}
    assert len(keys) == 2
    assert difference(solo(pipeline, half), solo(pipeline, full)) > 5


def test_an_unknown_adapter_is_refused_naming_the_model() -> None:
    pipeline = load_pipeline(config("tiny-sd"))
    sent = request(1, "nope")
    with pytest.raises(ValueError, match="unknown LoRA adapter 'nope'") as refused:
        pipeline.validate(pipeline.resolve(sent))
    assert getattr(refused.value, "param", None) == "model"


def test_tiny_loras_build_the_same_bytes_every_time(tmp_path: Path) -> None:
    def digest(root: Path) -> str:
        return hashlib.sha256(
            (tiny_lora_dir("tiny-lora-3", "tiny-sd", root) / WEIGHTS).read_bytes()
        ).hexdigest()

    assert digest(tmp_path / "one") == digest(tmp_path / "two")
    with pytest.raises(ValueError, match="tiny models only"):
        tiny_lora_dir("tiny-lora-3", "org/real-model", tmp_path)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda d: d / "missing.safetensors", "does not exist"),
        (lambda d: _write(d / "empty", b""), "no .safetensors file"),
        (lambda d: _write(d / "junk.safetensors", b"not a safetensors file"), "not a readable safetensors"),
    ],
)
def test_a_bad_adapter_stops_the_start_naming_it(tmp_path: Path, make: object, message: str) -> None:
    source = make(tmp_path)  # type: ignore[operator]
    bad = replace(config("tiny-sd"), lora_modules=(("broken", str(source)),))
    with pytest.raises(ValueError, match=f"LoRA adapter broken: .*{message}"):
        load_pipeline(bad)


def test_an_adapter_that_does_not_fit_fails_its_requests_only() -> None:
    """A LoRA made for another model passes the start check (it is a LoRA file) and fails at
    first use: its requests get the error, every other request is served as before, with
    its own adapter (a failed load in diffusers may switch the active adapter behind us).
    Served names may hold dots (PEFT's own names may not)."""
    fitting = (("style.v1.5", "tiny-lora-1"), ("b", "tiny-lora-2"))
    foreign = {  # matches no layer of tiny-sd; matches layers of another shape
        "flux": str(tiny_lora_dir("tiny-lora-1", "tiny-flux")),
        "sdxl": str(tiny_lora_dir("tiny-lora-1", "tiny-sdxl")),
    }
    pipeline = load_pipeline(replace(config("tiny-sd"), lora_modules=(*fitting, *foreign.items())))
    reference = load_pipeline(replace(config("tiny-sd"), lora_modules=fitting))
    expected = {name: solo(reference, request(1, name)) for name in (None, "style.v1.5", "b")}
    for bad in foreign:
        solo(pipeline, request(1, "style.v1.5"))
        solo(pipeline, request(1, "b"))  # both loaded, b active
        for _ in range(2):  # the second time from memory
            with pytest.raises(LoraLoadError, match=rf"'{bad}'.*cannot be loaded into tiny-sd"):
                solo(pipeline, request(1, bad))
        for name, image in expected.items():
            assert difference(solo(pipeline, request(1, name)), image) <= 1, (bad, name)


def test_a_hub_adapter_that_cannot_be_fetched_is_tried_again(tmp_path: Path) -> None:
    pipeline = load_pipeline(replace(config("tiny-sd"), lora_modules=(("hub", "no-such-org/no-such-lora"),)))
    for _ in range(2):  # not remembered: the hub may answer next time
        with pytest.raises(RuntimeError, match=r"'hub'.*cannot be loaded") as failed:
            solo(pipeline, request(1, "hub"))
        assert not isinstance(failed.value, LoraLoadError)
    assert "hub" not in pipeline.loras.broken  # type: ignore[attr-defined]


def _write(path: Path, data: bytes) -> Path:
    if path.suffix:
        path.write_bytes(data)
    else:
        path.mkdir()
    return path
