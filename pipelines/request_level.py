"""Request level: one diffusers call per batch of same-key requests, run to its end.

The batch's prompts and negative prompts go in as lists, each request's n expanded into
repeated prompts with one generator per image (never `num_images_per_prompt` with a list: it
pairs text masks with the wrong prompts in some families), and the images are split back per
request in order. Apart from the adapter because it is the one path that hands the whole
denoising loop to diffusers; step level (`pipelines.step_level`) runs its own.
`pipelines.adapter.DiffusersAdapter.forward` calls `forward` here.
"""

from __future__ import annotations

import inspect
import threading
from dataclasses import replace
from typing import Any, Protocol

import torch

from engine.request import ForwardInterrupted, GenerationRequest, RequestBatch, RequestOutput, SamplingParams
from pipelines.base import PipelineConfig, ProgressCallback
from pipelines.cache.whole_batch import whole_batch_cache
from pipelines.families.base import Family, TaskUse
from pipelines.outputs import resolved, split_outputs, to_arrays
from pipelines.schedule import timesteps_kwargs
from pipelines.tasks.base import Task


class Calling(Protocol):
    """What a request-level call reads of the adapter. Properties: read only here."""

    @property
    def family(self) -> Family: ...

    @property
    def config(self) -> PipelineConfig: ...

    @property
    def use(self) -> TaskUse: ...

    @property
    def task(self) -> Task: ...

    @property
    def pipe(self) -> Any: ...

    @property
    def progress_callback(self) -> ProgressCallback | None: ...

    @property
    def interrupt(self) -> threading.Event | None: ...

    def use_lora(self, params: SamplingParams) -> None: ...


def forward(adapter: Calling, batch: RequestBatch) -> list[RequestOutput]:
    """One output per request of `batch`, in order, with what the task keeps of its images."""
    task, family = adapter.task, adapter.family
    if adapter.use.one_image_per_call:
        return [_one_image_per_call(adapter, batch, request) for request in batch.requests]
    outputs = _call(adapter, batch)
    if batch.requests[0].params.output_type == "latent":
        return outputs
    return [
        replace(output, images=task.kept(family, request, output.images))
        for request, output in zip(batch.requests, outputs, strict=True)
    ]


def _one_image_per_call(adapter: Calling, batch: RequestBatch, request: GenerationRequest) -> RequestOutput:
    # n=2 is two calls, each a request of one image with its own seed.
    images: list[Any] = []
    for seed in request.params.image_seeds():
        single = replace(request, params=replace(request.params, n=1, seed=seed))
        images.extend(_call(adapter, RequestBatch(key=batch.key, requests=(single,)))[0].images)
    return RequestOutput(request.request_id, tuple(images), tuple(request.params.image_seeds()))


def _call(adapter: Calling, batch: RequestBatch) -> list[RequestOutput]:
    family, task, pipe = adapter.family, adapter.task, adapter.pipe
    shared = batch.requests[0].params  # every key field is equal across the batch
    prompts: list[str] = []
    negatives: list[str] = []
    generators: list[torch.Generator] = []
    for request in batch.requests:
        for seed in request.params.image_seeds():
            prompts.append(request.prompt)
            negatives.append(request.params.negative_prompt or "")
            # CPU generators give the same noise on every device, so a seed reproduces
            # an image across machines.
            generators.append(torch.Generator("cpu").manual_seed(seed))
    # With the negative prompt in the key, either every request has one or none does.
    in_key = family.guidance.negative_prompt_in_key
    negative_prompt = negatives if any(negatives) or not in_key else None
    # FLUX.2's calls take no negative prompt (its families refuse one at admission).
    negative = {"negative_prompt": negative_prompt} if _accepts(pipe, "negative_prompt") else {}
    adapter.use_lora(shared)
    with torch.inference_mode(), whole_batch_cache(family.cached_denoiser(), shared.cache):
        result = pipe(
            **family.call_inputs({"prompt": prompts, **negative, "generator": generators}),
            num_inference_steps=shared.num_inference_steps,
            output_type="latent" if shared.output_type == "latent" else "np",
            **{task.per_prompt_argument: 1},
            **family.call_kwargs(shared),
            **_size_kwargs(pipe, shared),
            **task.call_kwargs(shared),
            **timesteps_kwargs(adapter.config),
            **task.input_kwargs(family, batch),
            **progress_kwargs(adapter, batch, shared),
        )
    arrays = to_arrays(task.outputs_of(result), shared.output_type)
    return split_outputs(batch, arrays, family.extras_of(result))


def _size_kwargs(pipe: Any, params: SamplingParams) -> dict[str, Any]:
    # SD's and SDXL's img2img pipelines take no size: the input image, sent at the
    # output size, sets it.
    if not _accepts(pipe, "width"):
        return {}
    return {"width": params.width, "height": params.height}


def _accepts(pipe: Any, argument: str) -> bool:
    return argument in inspect.signature(pipe.__call__).parameters


def progress_kwargs(adapter: Calling, batch: RequestBatch, params: SamplingParams) -> dict[str, Any]:
    """A step-end callback that reports progress and stops the forward once nobody
    wants it (`interrupt`), so an abandoned batch frees the accelerator within a step."""
    report, interrupt = adapter.progress_callback, adapter.interrupt
    if report is None and interrupt is None:
        return {}
    # Some pipelines take no step callback (HunyuanVideo 1.5): no progress, no early stop.
    if not _accepts(adapter.pipe, "callback_on_step_end"):
        return {}
    request_ids, total = batch.request_ids, resolved(params.num_inference_steps)

    def on_step_end(pipe: Any, step: int, timestep: Any, tensors: dict[str, Any]) -> dict[str, Any]:
        if interrupt is not None and interrupt.is_set():
            raise ForwardInterrupted
        if report is not None:
            report(request_ids, step + 1, total)
        return tensors

    return {"callback_on_step_end": on_step_end}
