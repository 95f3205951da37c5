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
from abc import abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from engine.request import GenerationRequest, RequestBatch, RequestOutput, preview_steps

# Per-row conditioning of a denoiser call, by argument name; every tensor has one row per image.
Conditioning = dict[str, torch.Tensor]
# A request's encoded prompt: (positive rows, negative rows or None without guidance).
Encoded = tuple[Conditioning, Conditioning | None]
# (latent rows, per-row timesteps, conditioning) -> the denoiser's prediction for each row.
Denoiser = Callable[[torch.Tensor, torch.Tensor, Conditioning], torch.Tensor]
# Rows of many requests into one denoiser input (by default: concatenated).
Merge = Callable[[list[Conditioning]], Conditioning]
# (prediction without the prompt, prediction with it, scale) -> the guided prediction.
Guide = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]


def generators_for(request: GenerationRequest) -> list[torch.Generator]:
    """One CPU generator per image (seed, seed+1, ...), as in request mode: the same noise on
    every device, so a seed reproduces an image across machines."""
    return [torch.Generator("cpu").manual_seed(seed) for seed in request.params.image_seeds()]


def guidance_rows(embeds: torch.Tensor, scale: float) -> torch.Tensor:
    """A distilled-guidance input (FLUX.1-dev, guidance-distilled Qwen-Image): one per row."""
    return torch.full((embeds.shape[0],), scale, dtype=torch.float32, device=embeds.device)


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
    ) -> DenoiseState:
        """A request at step 0 of its own schedule."""
        cond, uncond = prompts
        timesteps = scheduler.timesteps
        kwargs = step_kwargs or {}
        params = request.params
        previews = preview_steps(len(timesteps), params.partial_images) if params.output_type == "np" else ()
        state = cls(request, scheduler, timesteps, latents, cond, uncond, guidance_scale, generators, kwargs)
        state.preview_at = previews
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


def own_scheduler(
    template: Any, num_inference_steps: int | None, device: torch.device | str, **kwargs: Any
) -> Any:
    """A copy of the pipeline's scheduler with this request's timesteps set (~0.2 ms), as
    diffusers' `retrieve_timesteps` sets them (flow models pass `sigmas` and `mu` instead
    of a step count)."""
    scheduler = copy.deepcopy(template)
    if num_inference_steps is None:
        scheduler.set_timesteps(device=device, **kwargs)
    else:
        scheduler.set_timesteps(num_inference_steps, device=device, **kwargs)
    return scheduler


def step_together(
    states: list[DenoiseState],
    denoise: Denoiser,
    merge: Merge = concatenate,
    guide: Guide = classifier_free,
) -> None:
    """Advance every state by one step with ONE denoiser forward.

    The forward runs before any state changes, so if it raises no request has moved and
    each can be retried alone.
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
    for state, noise in zip(states, guided, strict=True):
        index, sample = state.steps_done, state.latents
        t = state.timesteps[index]
        stepped = state.scheduler.step(noise, t, sample, **state.step_kwargs, return_dict=False)
        state.latents = stepped[0]
        state.steps_done += 1
        if state.steps_done in state.preview_at:
            state.preview = clean_estimate(state.scheduler, sample, noise, t=t, index=index, stepped=stepped)


def clean_estimate(
    scheduler: Any,
    sample: torch.Tensor,
    prediction: torch.Tensor,
    *,
    t: torch.Tensor,
    index: int,
    stepped: Any,
) -> torch.Tensor:
    """The scheduler's estimate of the finished latents at step `index` (what a preview shows):
    its own `pred_original_sample` where its step returns one (DDIM, Euler, LCM), else from
    the prediction: x - sigma*v for flow matching; (x - sqrt(1-a)*eps) / sqrt(a) for
    epsilon-prediction and sqrt(a)*x - sqrt(1-a)*v for v-prediction in variance-preserving
    schedulers (DPM-Solver, UniPC, PNDM), a = alphas_cumprod[t]. Anything else previews the
    noisy latents themselves."""
    if len(stepped) > 1 and isinstance(stepped[1], torch.Tensor):
        own: torch.Tensor = stepped[1]
        return own
    config = scheduler.config
    kind = config.get("prediction_type", None)
    if kind == "flow_prediction" or "FlowMatch" in type(scheduler).__name__:
        sigma: torch.Tensor = scheduler.sigmas[index].to(sample.device)
        return (sample.float() - sigma * prediction.float()).to(sample.dtype)
    alphas = getattr(scheduler, "alphas_cumprod", None)
    if alphas is None or float(getattr(scheduler, "init_noise_sigma", 1.0)) != 1.0:
        return sample
    alpha: torch.Tensor = alphas[int(t)].to(sample.device, torch.float32)
    x, out = sample.float(), prediction.float()
    if kind == "epsilon":
        estimate = (x - (1 - alpha).sqrt() * out) / alpha.sqrt()
    elif kind == "v_prediction":
        estimate = alpha.sqrt() * x - (1 - alpha).sqrt() * out
    elif kind == "sample":
        estimate = out
    else:
        return sample
    return estimate.to(sample.dtype)


class SteppedStages:
    """The prepare / step / finish stages of `pipelines.base.Pipeline`, for a family that
    fills in the hooks below. Mixed in before the family's request-level adapter."""

    supports_step_batch: ClassVar[bool] = True

    def prepare(self, requests: list[GenerationRequest]) -> list[Any]:
        if not requests:
            return []
        with torch.inference_mode():
            encoded = zip(requests, self._encode(requests), strict=True)
            return [self._prepare(request, cond, uncond) for request, (cond, uncond) in encoded]

    def step(self, states: list[Any]) -> None:
        def denoise(latents: torch.Tensor, timesteps: torch.Tensor, cond: Conditioning) -> torch.Tensor:
            return self._denoise(states, latents, timesteps, cond)

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
            return split_outputs(finished, to_arrays(self._decode(states, latents), "np"))

    def preview(self, states: list[Any]) -> list[tuple[np.ndarray, ...]]:
        """Decode the clean-latent estimates of `states` (one size) together: one preview
        tuple (n images) per state. The decode is the family's own, so a preview goes through
        the same VAE (and safety checker) as the final image."""
        from pipelines.text_to_image import to_arrays

        latents = torch.cat([state.preview for state in states])
        with torch.inference_mode():
            images = to_arrays(self._decode(states, latents), "np")
        previews, start = [], 0
        for state in states:
            previews.append(tuple(images[start : start + state.num_images]))
            start += state.num_images
        return previews

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


# Text encoding for all joiners: (texts) -> tensors with one row per text.
EncodeTexts = Callable[[list[str]], tuple[torch.Tensor, ...]]
# (request, its rows of each encoded tensor) -> its conditioning.
ToConditioning = Callable[[GenerationRequest, tuple[torch.Tensor, ...]], Conditioning]


def encode_together(
    requests: list[GenerationRequest],
    uses_cfg: Callable[[GenerationRequest], bool],
    encode: EncodeTexts,
    to_conditioning: ToConditioning,
) -> list[Encoded]:
    """Every joiner's prompt (n rows each) and, for those that `uses_cfg`, its negative
    prompt ("" when none), through the text encoders in ONE call; then each request's rows."""
    guided = [r for r in requests if uses_cfg(r)]
    texts = [r.prompt for r in requests for _ in range(r.params.n)]
    texts += [r.params.negative_prompt or "" for r in guided for _ in range(r.params.n)]
    sizes = [r.params.n for r in [*requests, *guided]]
    rows = iter(zip(*(torch.split(tensor, sizes) for tensor in encode(texts)), strict=True))
    positive = [to_conditioning(r, next(rows)) for r in requests]
    guided_ids = {r.request_id for r in guided}
    return [
        (cond, to_conditioning(r, next(rows)) if r.request_id in guided_ids else None)
        for r, cond in zip(requests, positive, strict=True)
    ]


def flow_scheduler(
    template: Any,
    steps: int,
    image_seq_len: int,
    device: torch.device | str,
    *,
    linear_sigmas: bool = True,
    max_shift: float = 1.15,
) -> Any:
    """A request's own flow-matching schedule, as FLUX, Qwen-Image and SD3 set theirs: sigmas
    1 → 1/steps with `linear_sigmas` (else the scheduler's own for the step count), shifted
    by `mu` from the image's token count where the scheduler shifts dynamically; the step
    index starts at 0."""
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    config = template.config
    kwargs: dict[str, Any] = {}
    if config.get("use_dynamic_shifting", None):
        kwargs["mu"] = calculate_shift(
            image_seq_len,
            config.get("base_image_seq_len", 256),
            config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.5),
            config.get("max_shift", max_shift),
        )
    if linear_sigmas:
        scheduler = own_scheduler(template, None, device, sigmas=np.linspace(1.0, 1 / steps, steps), **kwargs)
    else:
        scheduler = own_scheduler(template, steps, device, **kwargs)
    scheduler.set_begin_index(0)
    return scheduler
