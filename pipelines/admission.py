"""The adapter's answers at admission: a request's defaults (`resolve`), its checks
(`validate`), its keys (`batch_key`, `step_key`) and its step cost.

Apart from the adapter because these calls are pure and cheap and read configs only: the
engine makes them on its event loop, and with process workers the front process makes them
on a weightless `spec()` of the adapter. (`engine/core/admission.py` is the engine's half: the
seed, the admission wait.) `pipelines.adapter.DiffusersAdapter`'s methods call these.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Protocol

from engine.request import (
    BatchKey,
    GenerationRequest,
    InvalidRequestError,
    SamplingParams,
    UnsupportedFieldError,
)
from pipelines.base import PipelineConfig
from pipelines.cache.choice import check_cache, effective
from pipelines.cache.choice import resolved as resolved_cache
from pipelines.families.base import Family
from pipelines.outputs import resolved
from pipelines.redux_flux import redux_names, uses_redux
from pipelines.tasks.base import Task
from pipelines.work import DEFAULT_WORK_MULTIPLE, check_work, request_work, steps_for_quality

# The most steps a request may take, where the scheduler allows as many (`max_steps`).
MAX_STEPS = 1000


class Admitting(Protocol):
    """What admission reads of the adapter: its family, task and config, and the defaults it
    settled at load. Methods, not fields, where a subclass may override them."""

    family: Family
    config: PipelineConfig
    steps: int
    default_width: int
    default_height: int
    guidance_scale: float | None
    true_cfg_scale: float | None

    @property
    def task(self) -> Task: ...

    @property
    def size_multiple(self) -> int: ...

    def cache_refusal(self, mode: str) -> str | None: ...

    def max_steps(self) -> int: ...

    def default_params(self) -> SamplingParams: ...


def resolve(adapter: Admitting, request: GenerationRequest) -> SamplingParams:
    """The request's parameters with the model's defaults, then the task's and the family's."""
    task, family, config = adapter.task, adapter.family, adapter.config
    task.check_inputs(family, request)
    params = request.params
    if params.width is None and params.height is None:
        size = task.size_from_inputs(family, request)
        if size is not None:
            params = replace(params, width=size[0], height=size[1])
    else:
        _check_size_from_image(family, request)
    # With fixed timesteps every request takes them all, whatever its quality.
    quality = None if config.timesteps else params.quality
    steps = adapter.steps if quality is None else steps_for_quality(adapter.steps, quality)
    defaults: dict[str, Any] = {
        "width": adapter.default_width,
        "height": adapter.default_height,
        "num_inference_steps": steps,
        "guidance_scale": adapter.guidance_scale,
        "true_cfg_scale": adapter.true_cfg_scale,
        "negative_prompt": config.default_negative_prompt,
    }
    changes = {name: value for name, value in defaults.items() if getattr(params, name) is None}
    changes["cache"] = resolved_cache(params.cache, config.cache, quality, config.cache_threshold)
    params = task.complete(family, family.complete(replace(params, **changes)))
    _check_reference_tokens(adapter, request, params)
    return params


def _check_size_from_image(family: Family, request: GenerationRequest) -> None:
    """Where the family's pipeline sizes the video by its input image (HunyuanVideo 1.5
    image-to-video), a request's own size must be that one: the call would not honour
    another, and the step key must hold the size the latents have."""
    if not request.input_images:
        return
    fixed = family.size_from_image(request.input_images[0])
    params = request.params
    if fixed is not None and (params.width, params.height) != fixed:
        raise InvalidRequestError(
            f"this model sizes the video by its input image: {fixed[0]}x{fixed[1]} for this one; "
            "leave size out or send that size",
            "size",
        )


def validate(adapter: Admitting, params: SamplingParams) -> None:
    """Raise `InvalidRequestError` naming the first field of resolved `params` that cannot run
    here; the checks go in this order, so a request hears about its biggest problem first."""
    _check_size(adapter, params)
    _check_tokens(adapter, params)
    _check_steps(adapter, params)
    _check_fields_apply(adapter.task, adapter.family, params)
    served = dict(adapter.config.lora_modules)
    if params.lora is not None and params.lora.name not in served:
        known = ", ".join(sorted(served)) or "none"
        raise InvalidRequestError(f"unknown LoRA adapter {params.lora.name!r} (served: {known})", "model")
    check_cache(params.cache, adapter.cache_refusal)
    adapter.task.validate(adapter.family, params)
    adapter.family.validate(params)


def _check_size(adapter: Admitting, params: SamplingParams) -> None:
    width, height = resolved(params.width), resolved(params.height)
    multiple = adapter.size_multiple
    for name, value in (("width", width), ("height", height)):
        if value % multiple:
            raise InvalidRequestError(
                f"{name} must be a multiple of {multiple} for this model, got {value}", name
            )
    if width * height > adapter.config.max_pixels:
        raise InvalidRequestError(
            f"size {width}x{height} exceeds this server's limit of {adapter.config.max_pixels} pixels",
            "size",
        )


def _check_tokens(adapter: Admitting, params: SamplingParams) -> None:
    """diffusers cuts each sequence its context-parallel plan splits into equal shards. A
    video's tokens follow its frames as well as its size: the 400 names both."""
    degree = adapter.family.sequence_degree()
    if degree == 1:
        return
    video = params.num_frames is not None
    for part, tokens in adapter.family.sequence_lengths(params).items():
        if tokens % degree:
            frames = f" at {params.num_frames} frames" if video else ""
            what = f"size {params.width}x{params.height}{frames}"
            raise InvalidRequestError(
                f"{what} gives {tokens} {part} tokens, which --sequence-parallel {degree} cannot "
                f"split into equal parts: choose a size{' or frame count' if video else ''} whose "
                f"{part} tokens divide by {degree}",
                "size",
            )


def _check_reference_tokens(adapter: Admitting, request: GenerationRequest, params: SamplingParams) -> None:
    """A request's reference images join its own image tokens in the sequence the plan cuts:
    together they must divide by the degree."""
    degree = adapter.family.sequence_degree()
    references = adapter.family.reference_tokens(request) if degree > 1 else 0
    if not references:
        return
    own = adapter.family.sequence_lengths(params)["image"]
    if (own + references) % degree:
        raise InvalidRequestError(
            f"the input images add {references} image tokens to the {own} of size "
            f"{params.width}x{params.height}: {own + references}, which --sequence-parallel "
            f"{degree} cannot split into equal parts; resize an input image",
            "image",
        )


def _mixes_sizes(adapter: Admitting, request: GenerationRequest) -> bool:
    """Whether rows of other sizes may share this request's forwards: where the family pads
    them to one grid (`Family.mixes_sizes_for`), unless the lane splits tokens (the padding
    mask spans the whole sequence, which the devices hold a part of each)."""
    return adapter.family.mixes_sizes_for(adapter.task, request) and adapter.family.sequence_degree() == 1


def step_packs(adapter: Admitting, request: GenerationRequest) -> bool:
    """Whether the request's rows are packed end to end beside rows of other sizes rather
    than padded to one grid (`Family.packs_sizes_for`): a forward packs where every request
    in it does, else pads them all, so packing and padding requests share one step key."""
    return _mixes_sizes(adapter, request) and adapter.family.packs_sizes_for(adapter.task, request)


def _check_steps(adapter: Admitting, params: SamplingParams) -> None:
    # Before the steps limit: a request that asks for too much hears about the budget.
    default = adapter.default_params()
    budget = adapter.config.max_request_work or DEFAULT_WORK_MULTIPLE * request_work(default)
    check_work(params, budget, default)
    if resolved(params.num_inference_steps) > adapter.max_steps():
        raise InvalidRequestError(
            f"num_inference_steps must be at most {adapter.max_steps()} for this model, "
            f"got {params.num_inference_steps}",
            "num_inference_steps",
        )
    fixed = adapter.config.timesteps
    if fixed and params.num_inference_steps != len(fixed):
        raise InvalidRequestError(
            f"num_inference_steps must be {len(fixed)} for this model: it runs the fixed timesteps "
            f"{list(fixed)}",
            "num_inference_steps",
        )


def _check_fields_apply(task: Task, family: Family, params: SamplingParams) -> None:
    """Refuse a field this model has no use for, rather than ignore it silently."""
    for name in ("num_frames", "fps", "duration_s"):
        if not task.accepts_frames and getattr(params, name) is not None:
            raise UnsupportedFieldError(f"{name} applies to video models; this model makes images", name)
    if params.true_cfg_scale is not None and family.default_true_cfg_scale is None:
        raise UnsupportedFieldError("true_cfg_scale is not supported by this model", "true_cfg_scale")
    if params.guidance_scale_2 is not None and not family.two_experts():
        raise UnsupportedFieldError(
            "guidance_scale_2 applies to two-expert models (Wan 2.2 A14B); this model has one denoiser",
            "guidance_scale_2",
        )
    if params.conditioning_scale is not None and not task.accepts_control_video:
        raise UnsupportedFieldError(
            "conditioning_scale applies to controlled-video models (Wan VACE)", "conditioning_scale"
        )
    if params.strength is not None and not task.accepts_strength:
        raise UnsupportedFieldError("strength is not supported by this model", "strength")


def max_steps(pipe: Any) -> int:
    """MAX_STEPS, or fewer where the scheduler has fewer training timesteps: with
    `steps_offset` 1, DDIM at 1000 steps of 1000 would index timestep 1000 (IndexError)."""
    config = getattr(pipe.scheduler, "config", {})
    train = config.get("num_train_timesteps") or MAX_STEPS
    return min(MAX_STEPS, int(train) - int(config.get("steps_offset") or 0))


def default_params(adapter: Admitting) -> SamplingParams:
    """What a request that sets nothing asks for (n = 1), the measure of the work budget."""
    params = SamplingParams(
        width=adapter.default_width, height=adapter.default_height, num_inference_steps=adapter.steps
    )
    return adapter.task.default_params(adapter.family, params)


def batch_key(adapter: Admitting, request: GenerationRequest) -> BatchKey:
    """What requests sharing one diffusers call must share: the call takes one value of each."""
    family, params = adapter.family, request.params
    # diffusers cannot vary guidance per sample inside one call, so it is in the key.
    has_negative = bool(params.negative_prompt) if family.guidance.negative_prompt_in_key else None
    return (
        "text-to-image",
        params.width,
        params.height,
        params.num_inference_steps,
        params.guidance_scale,
        params.true_cfg_scale,
        params.guidance_scale_2,
        has_negative,
        params.output_type,
        params.lora,
        effective(params.cache),  # diffusers' hooks decide for the whole forward
        # Control images are not in it: a batch that carries one runs the family's own stages
        # (`DiffusersAdapter.forward`), which take each request's controls per row.
        *adapter.task.key_extras(family, request),
        *family.key_extras(params),
    )


def step_key(adapter: Admitting, request: GenerationRequest) -> BatchKey:
    # Steps, guidance and the negative prompt are per request: only the latent shape
    # (and what changes the weights) must be shared by one denoiser forward, unless the
    # family packs or pads rows of different sizes (`Family.mixes_sizes_for`).
    family, params = adapter.family, request.params
    return (
        family.key_name,
        *(("any size",) if _mixes_sizes(adapter, request) else (params.width, params.height)),
        *adapter.task.step_key_extras(family, request),
        *family.step_key_extras(params),
        params.output_type,
        params.lora,
        # FLUX Redux rows' text is longer than a plain prompt's (`pipelines.redux_flux`).
        *(("redux",) if uses_redux(request.ip_adapters, redux_names(adapter.config.ip_adapters)) else ()),
    )


def step_cost(adapter: Admitting, request: GenerationRequest, rows_cost: int) -> int:
    """`rows_cost` (the contract's rows x latent tokens, `Pipeline.step_cost`) for each pass
    the family makes, as the task counts it, plus the text tokens the rows attend to."""
    family = adapter.family
    passes = family.passes(request)  # negative rows too, and any extra pass
    cost = adapter.task.step_cost(family, request, passes * rows_cost)
    return cost + request.params.n * passes * family.context_tokens(request)


def step_grid(adapter: Admitting, request: GenerationRequest) -> tuple[int, ...]:
    """The request's token grid where its step key leaves the size out, else (): the step
    budget counts a group with a request that does not pack (`step_packs`) as padded to the
    grid holding them all (`engine.sched.step_fit.group_cost`)."""
    family = adapter.family
    return family.token_grid(request) if _mixes_sizes(adapter, request) else ()
