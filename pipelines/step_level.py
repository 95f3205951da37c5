"""Step level: the prepare / step / finish / preview stages of `pipelines.base.Pipeline`,
for an adapter that composes a family and a task (`pipelines.adapter.DiffusersAdapter`,
whose stage methods call these): the family's hooks around `state.step_together`, the
task's recipe for a request's first state, and what the task keeps of the images.

`finish` may run on a decode thread while `prepare`, `step` and `preview` run on the
stepping thread (`engine.worker.decoding`): every VAE call holds the family's `vae_lock`, because
VAEs keep per-call caches (Wan's and Qwen-Image's causal convolutions clear and fill a
feature cache on each encode and decode).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Protocol

import numpy as np
import torch

from engine.request import GenerationRequest, LoraRef, RequestBatch, RequestOutput, SamplingParams
from pipelines.base import PipelineConfig
from pipelines.cache.block_hooks import RowFirstBlockCache
from pipelines.cache.choice import effective, first_block_cache
from pipelines.cache.taylor_seer import RowTaylorSeer, taylor_seer_cache
from pipelines.families.base import Family
from pipelines.outputs import resolved, split_outputs, to_arrays
from pipelines.stepping.preview import LinearPreview
from pipelines.stepping.state import Conditioning, DenoiseState, LastMerge, RowSplit, step_together
from pipelines.tasks.base import Task


class Staged(Protocol):
    """What the stages read of the adapter."""

    family: Family
    config: PipelineConfig
    linear_preview: LinearPreview
    # The First-Block Cache hooks on its denoiser, installed at the first cached step.
    row_cache: RowFirstBlockCache | None
    # Step mode's TaylorSeer over its denoiser, made at the first step that uses it.
    taylor_seer: RowTaylorSeer | None
    # In a lane of several devices, how a step's forward is shared out between them
    # (`pipelines.parallel`); None: this device runs every row.
    row_split: RowSplit | None
    # The last step's merged conditioning, reused while its group steps on unchanged.
    last_merge: LastMerge

    @property
    def task(self) -> Task: ...

    def use_lora(self, params: SamplingParams) -> None: ...


def prepare(adapter: Staged, requests: list[GenerationRequest]) -> list[Any]:
    """Each request's first state. Joiners are encoded together per LoRA adapter: an
    adapter may change the text encoder too."""
    family, task = adapter.family, adapter.task
    groups: dict[LoraRef | None, list[int]] = {}
    for index, request in enumerate(requests):
        groups.setdefault(request.params.lora, []).append(index)
    states: list[Any] = [None] * len(requests)
    with torch.inference_mode():
        for indices in groups.values():
            joiners = [requests[i] for i in indices]
            adapter.use_lora(joiners[0].params)
            for index, request, prompts in zip(indices, joiners, family.encode(joiners, task), strict=True):
                states[index] = task.prepare(family, request, prompts)
                states[index].cache = first_block_cache(request.params)
                states[index].taylor_seer = taylor_seer_cache(effective(request.params.cache))
                if request.ip_adapters and family.ip_adapters is not None:
                    states[index].ip_embeds = family.ip_adapters.embeds(states[index])
    return states


def step(adapter: Staged, states: list[Any]) -> None:
    family, task = adapter.family, adapter.task
    # TaylorSeer's requests on a predicted step stay out of the forward.
    seer = _taylor_seer(adapter, states)
    seer_step = None if seer is None else seer.step(states)
    computing = states if seer_step is None else seer_step.computing
    known = None if seer_step is None else seer_step.known

    def denoise(
        seen: list[DenoiseState], latents: torch.Tensor, timesteps: torch.Tensor, cond: Conditioning
    ) -> torch.Tensor:
        return task.denoise(family, seen, latents, timesteps, cond)

    def learn(guided: list[torch.Tensor]) -> None:
        if seer is not None:
            seer.learn(seer_step, guided)

    def merge(conds: list[Conditioning]) -> Conditioning:
        return adapter.last_merge.merged(family.merge, conds)

    adapter.use_lora(states[0].request.params)  # the adapter is in the step key: one per group
    cache = _row_cache(adapter, computing)
    split = adapter.row_split
    with torch.inference_mode():
        if cache is None:
            step_together(states, denoise, merge, family.guide, known, before_commit=learn, split=split)
        else:
            with cache.step(computing) as cached:
                step_together(states, denoise, merge, family.guide, known, before_commit=learn, split=split)
            cache.commit(cached)  # only now: a step that raised leaves every cache as it was
        if seer is not None:
            seer.commit(seer_step)  # assignments only: the series were learnt before the states moved


def _taylor_seer(adapter: Staged, states: list[Any]) -> RowTaylorSeer | None:
    """The denoiser's per-request TaylorSeer where a request of the group uses it."""
    if all(state.taylor_seer is None for state in states):
        return None
    if adapter.taylor_seer is None:
        adapter.taylor_seer = RowTaylorSeer(adapter.family.step_denoiser)
    return adapter.taylor_seer


def _row_cache(adapter: Staged, states: list[Any]) -> RowFirstBlockCache | None:
    """The denoiser's per-request First-Block Cache where a request of the group caches."""
    if all(state.cache is None for state in states):
        return None
    if adapter.row_cache is None:
        denoisers = adapter.family.cached_denoisers()
        assert denoisers, "requests that cache were refused at admission otherwise"
        adapter.row_cache = RowFirstBlockCache(denoisers)
    return adapter.row_cache


def by_size(states: list[Any]) -> list[list[int]]:
    """Indices of `states` by image size, in order: a step group may mix sizes
    (`Family.mixes_sizes`), but a decode takes one."""
    sizes: dict[tuple[int | None, int | None], list[int]] = {}
    for index, state in enumerate(states):
        params = state.request.params
        sizes.setdefault((params.height, params.width), []).append(index)
    return list(sizes.values())


def finish(adapter: Staged, states: list[Any]) -> list[RequestOutput]:
    """Decode the states, each size together: one output per state, in order. In a lane of
    several devices only the lead decodes; the others' states (the same latents) end here."""
    adapter.last_merge.forget()  # requests finish: their prompt rows need not stay
    if not _decodes(adapter):
        return [RequestOutput(state.request.request_id, (), ()) for state in states]
    outputs: list[RequestOutput | None] = [None] * len(states)
    for indices in by_size(states):
        for index, output in zip(
            indices, _finish_one_size(adapter, [states[i] for i in indices]), strict=True
        ):
            outputs[index] = output
    return [output for output in outputs if output is not None]


def _finish_one_size(adapter: Staged, states: list[Any]) -> list[RequestOutput]:
    family = adapter.family
    finished = RequestBatch(key=(), requests=tuple(state.request for state in states))
    latents = torch.cat([state.latents for state in states])
    if states[0].request.params.output_type == "latent":
        return split_outputs(finished, to_arrays(latents, "latent"))
    with torch.inference_mode():
        with family.vae_lock:
            images = family.decode(states, latents)
            extras = family.decode_extras(states, latents)
        _learn_previews(adapter, states, latents, images)
    outputs = split_outputs(finished, to_arrays(images, "np"), extras)
    return [
        replace(output, images=adapter.task.kept(family, state.request, output.images))
        for state, output in zip(states, outputs, strict=True)
    ]


def _learn_previews(adapter: Staged, states: list[DenoiseState], latents: torch.Tensor, images: Any) -> None:
    """Give the linear preview the final images of the requests that asked for previews,
    to fit on its own thread (`LinearPreview.observe_later`). Nobody previewing, no fit:
    it would copy every final image to the CPU for nothing."""
    linear = linear_preview(adapter)
    rows: list[int] = []
    start = 0
    for state in states:
        if state.preview_at:
            rows.extend(range(start, start + state.num_images))
        start += state.num_images
    if linear is None or not rows:
        return
    grid = adapter.family.latent_grid(states, latents)
    if grid is None:
        return
    if len(rows) < start:  # new tensors: nothing here changes what the fit reads
        grid, images = grid[rows], np.asarray(images)[rows]
    linear.observe_later(grid, images)


def _decodes(adapter: Staged) -> bool:
    return adapter.row_split is None or adapter.row_split.leads


def preview(adapter: Staged, states: list[Any]) -> list[tuple[np.ndarray, ...]]:
    """The previews of `states`, each size decoded together (`_preview_one_size`), in order
    (none but the lead's in a lane of several devices)."""
    if not _decodes(adapter):
        return [()] * len(states)
    previews: list[tuple[np.ndarray, ...]] = [()] * len(states)
    for indices in by_size(states):
        for index, own in zip(indices, _preview_one_size(adapter, [states[i] for i in indices]), strict=True):
            previews[index] = own
    return previews


def _preview_one_size(adapter: Staged, states: list[Any]) -> list[tuple[np.ndarray, ...]]:
    """Decode the clean-latent estimates of `states` (one size) together: one preview tuple
    (n images) per state. With the VAE a preview goes through the family's own decode (and
    safety checker), as the final image does; with `linear` through the fitted map, once it
    has seen enough images. Each shows what the task keeps (the input outside an
    inpainting mask), as the final image will."""
    family = adapter.family
    latents = torch.cat([state.preview for state in states])
    with torch.inference_mode():
        linear = linear_preview(adapter)
        grid = None if linear is None or not linear.ready else family.latent_grid(states, latents)
        if linear is not None and grid is not None:
            params = states[0].request.params
            images = linear.decode(grid, resolved(params.height), resolved(params.width))
        else:
            with family.vae_lock:
                images = to_arrays(family.decode(states, latents), "np")
    previews, start = [], 0
    for state in states:
        own = tuple(images[start : start + state.num_images])
        previews.append(adapter.task.kept(family, state.request, own))
        start += state.num_images
    return previews


def linear_preview(adapter: Staged) -> LinearPreview | None:
    """The adapter's linear preview, where previews go through it: not where a safety
    checker judges decoded images (previews then go through it, as finals do)."""
    if (
        adapter.config.preview_decoder != "linear"
        or getattr(adapter.family.pipe, "safety_checker", None) is not None
    ):
        return None
    return adapter.linear_preview
