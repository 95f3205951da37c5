"""Step-level batching, the part every family shares: a request's denoising state, and one
denoising step taken by many requests in one denoiser forward.

Each request owns a copy of the pipeline's scheduler (schedulers keep per-run state: step
index, multistep history, `init_noise_sigma` after `set_timesteps`), its own latents and
generators, and its encoded prompt. A step concatenates every request's rows — its
negative rows first when it uses classifier-free guidance, then its positive rows — runs
the denoiser once with a per-row timestep, splits the prediction back, applies each
request's own guidance scale, and steps each request's own scheduler. Rows of a request
without guidance take the conditional prediction itself (`u + 1 * (c - u)` is not bitwise
`c`), so a request's image is the one the stock pipeline makes for it alone, within float
tolerance, whoever it shared its steps with.

A family supplies the rest through `SteppedStages`' hooks: how to encode its joiners,
set up one request, call its denoiser, and decode.
"""

from __future__ import annotations

import copy
import threading
from abc import abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import numpy as np
import torch

from engine.request import (
    GenerationRequest,
    LoraRef,
    RequestBatch,
    RequestOutput,
    SamplingParams,
    preview_steps,
)
from pipelines.base import PipelineConfig
from pipelines.preview import LinearPreview, clean_estimate
from pipelines.request_setup import Conditioning, Encoded
from pipelines.timing import CudaTimer, device_timer

# (latent rows, per-row timesteps, conditioning) -> the denoiser's prediction for each row.
Denoiser = Callable[[torch.Tensor, torch.Tensor, Conditioning], torch.Tensor]
# Rows of many requests into one denoiser input (by default: concatenated).
Merge = Callable[[list[Conditioning]], Conditioning]
# (prediction without the prompt, prediction with it, scale) -> the guided prediction.
Guide = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]


def concatenate(conds: list[Conditioning]) -> Conditioning:
    return {name: torch.cat([cond[name] for cond in conds]) for name in conds[0]}


def classifier_free(uncond: torch.Tensor, cond: torch.Tensor, scale: float) -> torch.Tensor:
    return uncond + scale * (cond - uncond)


@dataclass(eq=False)
class DenoiseState:
    """One request between its steps. `uncond` is None when it takes no guidance."""

    request: GenerationRequest
    scheduler: Any
    timesteps: torch.Tensor
    latents: torch.Tensor
    cond: Conditioning
    uncond: Conditioning | None
    guidance_scale: float
    generators: list[torch.Generator]
    step_kwargs: dict[str, Any] = field(default_factory=dict)
    steps_done: int = 0
    # Index of its first timestep in its scheduler's own: 0, or part-way for image-to-image,
    # whose strength skips the first steps (diffusers' `get_timesteps`).
    first_step: int = 0
    # Called after each of its scheduler steps (inpainting puts the input back outside the
    # mask there, as diffusers' inpainting pipelines do), or None.
    after_step: Callable[[DenoiseState], None] | None = None
    # After which steps to preview (`partial_images`), and the clean-latent estimate of the
    # last such step until it has been decoded and sent.
    preview_at: tuple[int, ...] = ()
    preview: torch.Tensor | None = None
    previews_sent: int = 0

    @classmethod
    def start(
        cls,
        request: GenerationRequest,
        scheduler: Any,
        latents: torch.Tensor,
        *,
        prompts: Encoded,
        guidance_scale: float,
        generators: list[torch.Generator],
        step_kwargs: dict[str, Any] | None = None,
        first_step: int = 0,
    ) -> DenoiseState:
        """A request at step 0 of its own schedule (its scheduler's from `first_step` on)."""
        cond, uncond = prompts
        timesteps = scheduler.timesteps[first_step:]
        kwargs = step_kwargs or {}
        params = request.params
        previews = preview_steps(len(timesteps), params.partial_images) if params.output_type == "np" else ()
        state = cls(request, scheduler, timesteps, latents, cond, uncond, guidance_scale, generators, kwargs)
        state.preview_at, state.first_step = previews, first_step
        return state

    @property
    def total_steps(self) -> int:
        return len(self.timesteps)

    @property
    def is_done(self) -> bool:
        return self.steps_done >= self.total_steps

    @property
    def num_images(self) -> int:
        return self.latents.shape[0]

    @property
    def rows(self) -> int:
        """Rows this request adds to a denoiser forward."""
        return self.latents.shape[0] * (1 if self.uncond is None else 2)


def step_together(
    states: list[DenoiseState],
    denoise: Denoiser,
    merge: Merge = concatenate,
    guide: Guide = classifier_free,
) -> None:
    """Advance every state by one step with ONE denoiser forward.

    Nothing changes until every row has been computed: the forward, then each request's
    scheduler step on a trial copy (`_trial_step`). Only when all have succeeded are the
    states committed, so if anything raises no request has moved (its scheduler history
    and its generators included) and each can be retried alone.
    """
    inputs: list[torch.Tensor] = []
    times: list[torch.Tensor] = []
    conds: list[Conditioning] = []
    for state in states:
        t = state.timesteps[state.steps_done]
        x = state.latents
        if hasattr(state.scheduler, "scale_model_input"):
            x = state.scheduler.scale_model_input(x, t)
        for cond in (state.uncond, state.cond):
            if cond is None:
                continue
            inputs.append(x)
            conds.append(cond)
            times.append(t.reshape(1).to(torch.float32).expand(x.shape[0]))
    prediction = denoise(torch.cat(inputs), torch.cat(times), merge(conds))
    guided = []
    offset = 0
    for state in states:
        n = state.latents.shape[0]
        if state.uncond is None:
            guided.append(prediction[offset : offset + n])
        else:
            without, with_text = prediction[offset : offset + n], prediction[offset + n : offset + 2 * n]
            guided.append(guide(without, with_text, state.guidance_scale))
        offset += state.rows
    generators = _generator_states(states)
    try:
        trials = [_trial_step(state, noise) for state, noise in zip(states, guided, strict=True)]
    except BaseException:
        # An ancestral scheduler drew noise for the requests before the failing one.
        for generator, saved in generators:
            generator.set_state(saved)
        raise
    for state, trial in zip(states, trials, strict=True):
        vars(state).update(vars(trial))


def _trial_step(state: DenoiseState, noise: torch.Tensor) -> DenoiseState:
    """`state` after its scheduler step with `noise`, as a new state on a fork of its
    scheduler: `state` itself is left as it was."""
    index, sample = state.steps_done, state.latents
    t = state.timesteps[index]
    trial = replace(state, scheduler=_fork(state.scheduler))
    stepped = trial.scheduler.step(noise, t, sample, **state.step_kwargs, return_dict=False)
    trial.latents = stepped[0]
    trial.steps_done = index + 1
    if trial.after_step is not None:
        trial.after_step(trial)
    if trial.steps_done in trial.preview_at:
        at = trial.first_step + index
        trial.preview = clean_estimate(trial.scheduler, sample, noise, t=t, index=at, stepped=stepped)
    return trial


def _fork(scheduler: Any) -> Any:
    """A copy of `scheduler` that its `step` can advance without touching the original:
    schedulers rebind their counters and tensors, but keep multistep history in lists they
    change in place (`model_outputs`, `timestep_list`, `ets`, `derivatives`), so those are
    copied; the tensors themselves are shared, never copied."""
    fork = copy.copy(scheduler)
    for name, value in vars(scheduler).items():
        if isinstance(value, list | dict | set):
            setattr(fork, name, copy.copy(value))
    return fork


def _generator_states(states: list[DenoiseState]) -> list[tuple[torch.Generator, torch.Tensor]]:
    """Each generator a scheduler step draws from (an ancestral scheduler's, passed in its
    `step_kwargs`), with its state now."""
    generators: dict[int, torch.Generator] = {}
    for state in states:
        drawn = state.step_kwargs.get("generator")
        for generator in drawn if isinstance(drawn, list) else [drawn] if drawn is not None else []:
            generators[id(generator)] = generator
    return [(generator, generator.get_state()) for generator in generators.values()]


class SteppedStages:
    """The prepare / step / finish stages of `pipelines.base.Pipeline`, for a family that
    fills in the hooks below. Mixed in before the family's request-level adapter.

    `finish` may run on a decode thread while `prepare`, `step` and `preview` run on the
    stepping thread (`engine.decoding`): every VAE call holds `vae_lock`, because VAEs keep
    per-call caches (Wan's and Qwen-Image's causal convolutions clear and fill a feature
    cache on each encode and decode)."""

    supports_step_batch: ClassVar[bool] = True
    config: PipelineConfig  # the adapter's own
    pipe: Any  # the diffusers pipeline
    device: torch.device  # where its inputs go (the adapter's)
    use_lora: Callable[[SamplingParams], None]  # the request-level adapter's

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.vae_lock = threading.Lock()
        # With `preview_decoder: linear`: the latent-to-RGB map, fitted on the final decodes
        # of requests that preview.
        self.linear_preview = LinearPreview()

    def __getstate__(self) -> dict[str, Any]:
        # Locks do not pickle (`spec()` crosses to another process); a copy gets its own.
        state = dict(self.__dict__)
        state.pop("vae_lock", None)
        state.pop("linear_preview", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.vae_lock = threading.Lock()
        self.linear_preview = LinearPreview()

    def stage_timer(self) -> CudaTimer | None:
        """CUDA events on a GPU (the runner times each step on the device, not its kernel
        launches); None on the CPU: the host's clock."""
        return device_timer(self.device)

    def prepare(self, requests: list[GenerationRequest]) -> list[Any]:
        # Joiners are encoded together per LoRA adapter: an adapter may change the text
        # encoder too.
        groups: dict[LoraRef | None, list[int]] = {}
        for index, request in enumerate(requests):
            groups.setdefault(request.params.lora, []).append(index)
        states: list[Any] = [None] * len(requests)
        with torch.inference_mode():
            for indices in groups.values():
                joiners = [requests[i] for i in indices]
                self.use_lora(joiners[0].params)
                encoded = zip(indices, joiners, self._encode(joiners), strict=True)
                for index, request, (cond, uncond) in encoded:
                    states[index] = self._prepare(request, cond, uncond)
        return states

    def step(self, states: list[Any]) -> None:
        def denoise(latents: torch.Tensor, timesteps: torch.Tensor, cond: Conditioning) -> torch.Tensor:
            return self._denoise(states, latents, timesteps, cond)

        self.use_lora(states[0].request.params)  # the adapter is in the step key: one per group
        with torch.inference_mode():
            step_together(states, denoise, self._merge, self._guide)

    def finish(self, states: list[Any]) -> list[RequestOutput]:
        # Imported here: text_to_image is the request-level adapter these stages sit beside.
        from pipelines.text_to_image import split_outputs, to_arrays

        finished = RequestBatch(key=(), requests=tuple(state.request for state in states))
        latents = torch.cat([state.latents for state in states])
        if states[0].request.params.output_type == "latent":
            return split_outputs(finished, to_arrays(latents, "latent"))
        with torch.inference_mode():
            with self.vae_lock:
                images = self._decode(states, latents)
            self._learn_previews(states, latents, images)
        return split_outputs(finished, to_arrays(images, "np"))

    def _learn_previews(self, states: list[Any], latents: torch.Tensor, images: Any) -> None:
        """Give the linear preview the final images of the requests that asked for previews,
        to fit on its own thread (`LinearPreview.observe_later`). Nobody previewing, no fit:
        it would copy every final image to the CPU for nothing."""
        linear = self._linear()
        rows: list[int] = []
        start = 0
        for state in states:
            if state.preview_at:
                rows.extend(range(start, start + state.num_images))
            start += state.num_images
        if linear is None or not rows:
            return
        grid = self._latent_grid(states, latents)
        if grid is None:
            return
        if len(rows) < start:  # new tensors: nothing here changes what the fit reads
            grid, images = grid[rows], np.asarray(images)[rows]
        linear.observe_later(grid, images)

    def preview(self, states: list[Any]) -> list[tuple[np.ndarray, ...]]:
        """Decode the clean-latent estimates of `states` (one size) together: one preview
        tuple (n images) per state. With the VAE a preview goes through the family's own
        decode (and safety checker), as the final image does; with `linear` through the
        fitted map, once it has seen enough images."""
        from pipelines.text_to_image import resolved, to_arrays

        latents = torch.cat([state.preview for state in states])
        with torch.inference_mode():
            linear = self._linear()
            grid = None if linear is None or not linear.ready else self._latent_grid(states, latents)
            if linear is not None and grid is not None:
                params = states[0].request.params
                images = linear.decode(grid, resolved(params.height), resolved(params.width))
            else:
                with self.vae_lock:
                    images = to_arrays(self._decode(states, latents), "np")
        previews, start = [], 0
        for state in states:
            previews.append(tuple(images[start : start + state.num_images]))
            start += state.num_images
        return previews

    def _linear(self) -> LinearPreview | None:
        # A safety checker judges decoded images: previews then go through it, as finals do.
        if self.config.preview_decoder != "linear" or getattr(self.pipe, "safety_checker", None) is not None:
            return None
        return self.linear_preview

    def _latent_grid(self, states: list[Any], latents: torch.Tensor) -> torch.Tensor | None:
        """Latents as (B, C, h, w), one vector per latent pixel, for the linear preview; None
        where the family has no such view (video)."""
        return latents if latents.ndim == 4 else None

    @abstractmethod
    def _encode(self, requests: list[GenerationRequest]) -> list[Encoded]:
        """Every joiner's conditioning, in one text-encoder call where the family allows."""

    @abstractmethod
    def _prepare(self, request: GenerationRequest, cond: Conditioning, uncond: Conditioning | None) -> Any:
        """The request's state: its own scheduler copy, latents from its generators."""

    @abstractmethod
    def _denoise(
        self, states: list[Any], latents: torch.Tensor, timesteps: torch.Tensor, cond: Conditioning
    ) -> torch.Tensor:
        """One denoiser forward over the merged rows of `states`, each at its own timestep."""

    @abstractmethod
    def _decode(self, states: list[Any], latents: torch.Tensor) -> Any:
        """Latents of finished requests (one size) to float images in [0, 1], HxWx3 numpy."""

    def _merge(self, conds: list[Conditioning]) -> Conditioning:
        return concatenate(conds)

    def _guide(self, uncond: torch.Tensor, cond: torch.Tensor, scale: float) -> torch.Tensor:
        return classifier_free(uncond, cond, scale)
