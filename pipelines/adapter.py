"""The one adapter between the engine and a diffusers pipeline: a family (what the network
is, `pipelines.families`) composed with a task (what the request asks, `pipelines.tasks`).

Request level: one diffusers call per batch, the batch's prompts and negative prompts as
lists, each request's n expanded into repeated prompts with one generator per image (never
`num_images_per_prompt` with a list: it pairs text masks with the wrong prompts in some
families), and the images split back per request in order.

Step level: the stages of `pipelines.base.Pipeline` (`prepare`, `step`, `finish`,
`preview`) around `pipelines.stepping.state.step_together`, with the family's hooks and the
task's recipe for a request's first state.

The registry composes one subclass per (family, diffusers class) it serves
(`pipelines.registry.composed`); this class itself is the generic text-to-image adapter
(request level, diffusers' usual defaults).
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import replace
from typing import Any, ClassVar, Self

import torch
from diffusers import DiffusionPipeline

from engine.request import (
    BatchKey,
    ForwardInterrupted,
    GenerationRequest,
    InvalidRequestError,
    RequestBatch,
    RequestOutput,
    SamplingParams,
)
from pipelines.base import Pipeline, PipelineConfig
from pipelines.cache.block_hooks import RowFirstBlockCache
from pipelines.cache.choice import check_cache, effective
from pipelines.cache.choice import resolved as resolved_cache
from pipelines.cache.taylor_seer import RowTaylorSeer
from pipelines.cache.whole_batch import whole_batch_cache
from pipelines.decode import decode_in_halves, out_of_memory_count
from pipelines.denoiser.compiling import compiled_graphs
from pipelines.families.base import GENERIC_TEXT_TO_IMAGE, Family, TaskUse
from pipelines.loading import weightless
from pipelines.lora import LoraAdapters
from pipelines.memory.loading import release
from pipelines.outputs import resolved, split_outputs, to_arrays
from pipelines.prompt_cache import PromptCache, lora_scope
from pipelines.prompt_cache import install as install_prompt_cache
from pipelines.schedule import timesteps_kwargs
from pipelines.stepping import stages
from pipelines.stepping.preview import LinearPreview
from pipelines.tasks.base import Task
from pipelines.timing import CudaTimer, device_timer
from pipelines.work import DEFAULT_WORK_MULTIPLE, check_work, request_work, steps_for_quality

MAX_STEPS = 1000

# Adapters composed so far, by (family, diffusers class): the first class declared for a
# pair (an old name in `pipelines.aliases`) is the one the registry hands out.
_COMPOSED: dict[tuple[type[Family], str], type[DiffusersAdapter]] = {}


class DiffusersAdapter(Pipeline):
    supports_request_batch: ClassVar[bool] = True
    family_class: ClassVar[type[Family]] = Family
    use: ClassVar[TaskUse] = GENERIC_TEXT_TO_IMAGE

    def __init_subclass__(
        cls,
        *,
        family: type[Family] | None = None,
        serves: str | None = None,
        task: Task | None = None,
        **kwargs: Any,
    ) -> None:
        """`family` and `serves` (a diffusers class in the family's `uses`) compose the
        adapter for that use; `task` alone gives the generic family another task."""
        super().__init_subclass__(**kwargs)
        if family is not None:
            cls.family_class = family
            cls.use = family.use_for(serves) if serves is not None else TaskUse(task or cls.use.task, "")
        elif task is not None:
            cls.use = TaskUse(task, "")
        if family is None and task is None:
            return
        use = cls.use
        # Class attributes: the server and bench read them without loading anything.
        cls.modality = use.task.modality
        cls.input_image_count = use.images or use.task.input_images
        cls.accepts_mask = use.task.accepts_mask
        cls.accepts_control_video = use.task.accepts_control_video
        cls.supports_request_batch = use.request_batch
        if family is not None and serves is not None:
            _COMPOSED.setdefault((family, serves), cls)

    def __init__(self, pipe: DiffusionPipeline, config: PipelineConfig) -> None:
        self.config = config
        self.family = self.family_class(pipe, config, self.use)
        default_size = config.default_size or self.task.default_size or self.family.default_size()
        self.default_width, self.default_height = default_size
        # Fixed timesteps (a distilled model's) are the steps every request takes, whatever an
        # embedded model's default.
        self.steps = len(config.timesteps) or config.default_steps or self.family.default_steps
        if config.timesteps and "timesteps" not in inspect.signature(pipe.__call__).parameters:
            raise ValueError(f"timesteps: {type(pipe).__name__}'s call takes no fixed timesteps")
        guidance = config.default_guidance_scale
        self.guidance_scale = self.family.default_guidance_scale if guidance is None else guidance
        true_cfg = config.default_true_cfg_scale
        self.true_cfg_scale = self.family.default_true_cfg_scale if true_cfg is None else true_cfg
        if (
            config.default_negative_prompt is not None
            and "negative_prompt" not in inspect.signature(pipe.__call__).parameters
        ):
            raise ValueError(f"default_negative_prompt: {type(pipe).__name__} takes no negative prompt")
        # Read here, where the weights are: `spec()`'s weightless copy (the front process's,
        # with process workers) answers admission with it.
        denoiser = self.family.cached_denoiser()
        self.whole_batch_hooks = denoiser is not None and hasattr(denoiser, "enable_cache")
        served_cache = effective(config.cache)
        refusal = None if served_cache is None else self.cache_refusal(served_cache.mode)
        if refusal is not None:
            raise ValueError(
                f"cache: {type(pipe).__name__} cannot be served with cache mode "
                f"{config.cache.mode!r}: {refusal}"
            )
        self.loras: LoraAdapters | None = LoraAdapters(pipe, config)
        self.loras.check()
        # Identical prompts are encoded once while they stay cached, at request and step
        # level alike: the cache sits on the pipeline's own `encode_prompt`.
        self.prompt_cache: PromptCache | None = install_prompt_cache(
            pipe, config.prompt_cache_mb, self._lora_scope
        )
        # A decode that runs out of memory is retried in halves on the latents it was given,
        # so the forward (and its denoising) need not run again (`pipelines.decode`).
        decode_in_halves(getattr(pipe, "vae", None))
        # With `preview_decoder: linear`: the latent-to-RGB map, fitted on the final decodes
        # of requests that preview.
        self.linear_preview = LinearPreview()
        # Step mode's per-request First-Block Cache, installed at the first step that caches.
        self.row_cache: RowFirstBlockCache | None = None
        # Step mode's per-request TaylorSeer, made at the first step that uses it.
        self.taylor_seer: RowTaylorSeer | None = None

    @classmethod
    def load(cls, config: PipelineConfig) -> Self:
        return cls(cls.family_class.load_pipe(cls.use, config), config)

    @property
    def task(self) -> Task:
        return self.use.task

    @property
    def pipe(self) -> Any:
        """The diffusers pipeline (tests change its scheduler in place)."""
        return self.family.pipe

    @property
    def device(self) -> torch.device:
        return self.family.device

    @property
    def size_multiple(self) -> int:
        return self.family.size_multiple

    @property
    def default_true_cfg_scale(self) -> float | None:
        return self.family.default_true_cfg_scale

    def cache_refusal(self, mode: str) -> str | None:
        """Why requests here may not choose cache `mode`, or None where they may. In step mode
        each request decides for itself inside a shared step, where the family says it can
        (`Family.step_cache_modes`); a request-level call needs diffusers' own hooks on the
        denoiser (`CacheMixin.enable_cache`, which SD3's transformer lacks in diffusers 0.42.1)."""
        request_level = self.config.denoiser.warmup_batching == "request" or not self.supports_step_batch
        if not request_level:
            if mode in self.family.step_cache_modes():
                return None
            return "its denoiser does not take this cache per request in a shared step"
        if not self.whole_batch_hooks:
            return "diffusers' cache hooks do not fit its denoiser with request-level batching"
        return None

    @property
    def supports_step_batch(self) -> bool:  # type: ignore[override]
        # Fixed timesteps step only where the family's stages set them on each request's
        # scheduler copy; elsewhere the request-level call takes them.
        fixed_ok = not self.config.timesteps or self.family.fixed_timesteps
        return self.use.stepped and self.family.steps() and fixed_ok

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("linear_preview", None)
        state.pop("row_cache", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.linear_preview = LinearPreview()
        self.row_cache = None
        self.taylor_seer = None

    def cache_blocks_skipped(self) -> int:
        """Denoiser blocks skipped by step mode's First-Block Cache and TaylorSeer so far, over
        all requests (the step stages report them for `/metrics`)."""
        first_block = 0 if self.row_cache is None else self.row_cache.blocks_skipped
        return first_block + (0 if self.taylor_seer is None else self.taylor_seer.blocks_skipped)

    def decode_out_of_memory(self) -> int:
        """Decodes that ran out of memory and were halved so far (`engine.forward` reports
        them for `/metrics`)."""
        return out_of_memory_count(getattr(self.pipe, "vae", None))

    def prompt_cache_counts(self) -> dict[str, float] | None:
        """The prompt cache's cumulative counts (`engine.forward` reports them for
        `/metrics`), or None without one."""
        return self.prompt_cache.counts() if self.prompt_cache is not None else None

    def _lora_scope(self) -> Any:
        return lora_scope(self.loras.active if self.loras is not None else None)

    def compiled_graphs(self) -> int:
        """Graphs torch.compile has compiled so far for a compiled denoiser (`engine.forward`
        reports each forward's share for `/metrics`); 0 when not compiled."""
        return compiled_graphs() if self.config.denoiser.compile != "off" else 0

    def spec(self) -> Self:
        # The adapter over a weightless copy of its diffusers pipeline: every pure call
        # reads configs only (sizes, the scheduler's timesteps, the VAE's frame step).
        shell = copy.copy(self)
        shell.family = copy.copy(self.family)
        shell.family.pipe = weightless(self.pipe)
        shell.family.pipe.__dict__.pop("encode_prompt", None)  # the prompt cache's: the pipe's own
        shell.progress_callback = shell.interrupt = None
        shell.loras = None
        return shell

    def close(self) -> None:
        release(self.pipe)

    def stage_timer(self) -> CudaTimer | None:
        """CUDA events on a GPU (the runner times each step on the device, not its kernel
        launches); None on the CPU: the host's clock."""
        return device_timer(self.device)

    # Admission ------------------------------------------------------------------------------

    def resolve(self, request: GenerationRequest) -> SamplingParams:
        self.task.check_inputs(self.family, request)
        params = request.params
        if params.width is None and params.height is None:
            size = self.task.size_from_inputs(self.family, request)
            if size is not None:
                params = replace(params, width=size[0], height=size[1])
        else:
            self._check_size_from_image(request)
        # With fixed timesteps every request takes them all, whatever its quality.
        quality = None if self.config.timesteps else params.quality
        steps = self.steps if quality is None else steps_for_quality(self.steps, quality)
        defaults: dict[str, Any] = {
            "width": self.default_width,
            "height": self.default_height,
            "num_inference_steps": steps,
            "guidance_scale": self.guidance_scale,
            "true_cfg_scale": self.true_cfg_scale,
            "negative_prompt": self.config.default_negative_prompt,
        }
        changes = {name: value for name, value in defaults.items() if getattr(params, name) is None}
        config = self.config
        changes["cache"] = resolved_cache(params.cache, config.cache, quality, config.cache_threshold)
        params = replace(params, **changes)
        return self.task.complete(self.family, self.family.complete(params))

    def _check_size_from_image(self, request: GenerationRequest) -> None:
        """Where the family's pipeline sizes the video by its input image (HunyuanVideo 1.5
        image-to-video), a request's own size must be that one: the call would not honour
        another, and the step key must hold the size the latents have."""
        if not request.input_images:
            return
        fixed = self.family.size_from_image(request.input_images[0])
        params = request.params
        if fixed is not None and (params.width, params.height) != fixed:
            raise InvalidRequestError(
                f"this model sizes the video by its input image: {fixed[0]}x{fixed[1]} for this one; "
                "leave size out or send that size",
                "size",
            )

    def validate(self, params: SamplingParams) -> None:
        width, height = resolved(params.width), resolved(params.height)
        multiple = self.size_multiple
        for name, value in (("width", width), ("height", height)):
            if value % multiple:
                raise InvalidRequestError(
                    f"{name} must be a multiple of {multiple} for this model, got {value}", name
                )
        if width * height > self.config.max_pixels:
            raise InvalidRequestError(
                f"size {width}x{height} exceeds this server's limit of {self.config.max_pixels} pixels",
                "size",
            )
        # Before the steps limit: a request that asks for too much hears about the budget.
        default = self.default_params()
        budget = self.config.max_request_work or DEFAULT_WORK_MULTIPLE * request_work(default)
        check_work(params, budget, default)
        if resolved(params.num_inference_steps) > self.max_steps():
            raise InvalidRequestError(
                f"num_inference_steps must be at most {self.max_steps()} for this model, "
                f"got {params.num_inference_steps}",
                "num_inference_steps",
            )
        fixed = self.config.timesteps
        if fixed and params.num_inference_steps != len(fixed):
            raise InvalidRequestError(
                f"num_inference_steps must be {len(fixed)} for this model: it runs the fixed timesteps "
                f"{list(fixed)}",
                "num_inference_steps",
            )
        for name in ("num_frames", "fps", "duration_s"):
            if not self.task.accepts_frames and getattr(params, name) is not None:
                raise InvalidRequestError(f"{name} applies to video models; this model makes images", name)
        if params.true_cfg_scale is not None and self.family.default_true_cfg_scale is None:
            raise InvalidRequestError("true_cfg_scale is not supported by this model", "true_cfg_scale")
        if params.guidance_scale_2 is not None and not self.family.two_experts():
            raise InvalidRequestError(
                "guidance_scale_2 applies to two-expert models (Wan 2.2 A14B); this model has one denoiser",
                "guidance_scale_2",
            )
        if params.conditioning_scale is not None and not self.task.accepts_control_video:
            raise InvalidRequestError(
                "conditioning_scale applies to controlled-video models (Wan VACE)", "conditioning_scale"
            )
        if params.strength is not None and not self.task.accepts_strength:
            raise InvalidRequestError("strength is not supported by this model", "strength")
        served = dict(self.config.lora_modules)
        if params.lora is not None and params.lora.name not in served:
            known = ", ".join(sorted(served)) or "none"
            raise InvalidRequestError(f"unknown LoRA adapter {params.lora.name!r} (served: {known})", "model")
        check_cache(params.cache, self.cache_refusal)
        self.task.validate(self.family, params)
        self.family.validate(params)

    def max_steps(self) -> int:
        """MAX_STEPS, or fewer where the scheduler has fewer training timesteps: with
        `steps_offset` 1, DDIM at 1000 steps of 1000 would index timestep 1000 (IndexError)."""
        config = getattr(self.pipe.scheduler, "config", {})
        train = config.get("num_train_timesteps") or MAX_STEPS
        return min(MAX_STEPS, int(train) - int(config.get("steps_offset") or 0))

    def default_params(self) -> SamplingParams:
        """What a request that sets nothing asks for (n = 1), the measure of the work budget."""
        params = SamplingParams(
            width=self.default_width, height=self.default_height, num_inference_steps=self.steps
        )
        return self.task.default_params(self.family, params)

    def reduce_inputs(self, request: GenerationRequest) -> GenerationRequest:
        return self.task.reduce_inputs(self.family, request)

    def batch_key(self, request: GenerationRequest) -> BatchKey:
        params = request.params
        # diffusers cannot vary guidance per sample inside one call, so it is in the key.
        has_negative = bool(params.negative_prompt) if self.family.guidance.negative_prompt_in_key else None
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
            *self.task.key_extras(self.family, request),
            *self.family.key_extras(params),
        )

    def step_key(self, request: GenerationRequest) -> BatchKey:
        # Steps, guidance and the negative prompt are per request: only the latent shape
        # (and what changes the weights) must be shared by one denoiser forward.
        params = request.params
        return (
            self.family.key_name,
            params.width,
            params.height,
            *self.task.step_key_extras(self.family, request),
            *self.family.step_key_extras(params),
            params.output_type,
            params.lora,
        )

    def step_cost(self, request: GenerationRequest) -> int:
        passes = self.family.passes(request)  # negative rows too, and any extra pass
        cost = self.task.step_cost(self.family, request, passes * super().step_cost(request))
        return cost + request.params.n * passes * self.family.context_tokens(request)

    # Request level --------------------------------------------------------------------------

    def forward(self, batch: RequestBatch) -> list[RequestOutput]:
        if self.use.one_image_per_call:
            return [self._one_image_per_call(batch, request) for request in batch.requests]
        outputs = self._call(batch)
        if batch.requests[0].params.output_type == "latent":
            return outputs
        return [
            replace(output, images=self.task.kept(self.family, request, output.images))
            for request, output in zip(batch.requests, outputs, strict=True)
        ]

    def _one_image_per_call(self, batch: RequestBatch, request: GenerationRequest) -> RequestOutput:
        # n=2 is two calls, each a request of one image with its own seed.
        images: list[Any] = []
        for seed in request.params.image_seeds():
            single = replace(request, params=replace(request.params, n=1, seed=seed))
            images.extend(self._call(RequestBatch(key=batch.key, requests=(single,)))[0].images)
        return RequestOutput(request.request_id, tuple(images), tuple(request.params.image_seeds()))

    def _call(self, batch: RequestBatch) -> list[RequestOutput]:
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
        in_key = self.family.guidance.negative_prompt_in_key
        negative_prompt = negatives if any(negatives) or not in_key else None
        # FLUX.2's calls take no negative prompt (its families refuse one at admission).
        negative = {"negative_prompt": negative_prompt} if self._accepts("negative_prompt") else {}
        self.use_lora(shared)
        with torch.inference_mode(), whole_batch_cache(self.family.cached_denoiser(), shared.cache):
            result = self.pipe(
                **self.family.call_inputs({"prompt": prompts, **negative, "generator": generators}),
                num_inference_steps=shared.num_inference_steps,
                output_type="latent" if shared.output_type == "latent" else "np",
                **{self.task.per_prompt_argument: 1},
                **self.family.call_kwargs(shared),
                **self._size_kwargs(shared),
                **self.task.call_kwargs(shared),
                **timesteps_kwargs(self.config),
                **self.task.input_kwargs(self.family, batch),
                **self._progress_kwargs(batch, shared),
            )
        arrays = to_arrays(self.task.outputs_of(result), shared.output_type)
        return split_outputs(batch, arrays, self.family.extras_of(result))

    def _size_kwargs(self, params: SamplingParams) -> dict[str, Any]:
        # SD's and SDXL's img2img pipelines take no size: the input image, sent at the
        # output size, sets it.
        if not self._accepts("width"):
            return {}
        return {"width": params.width, "height": params.height}

    def _accepts(self, argument: str) -> bool:
        return argument in inspect.signature(self.pipe.__call__).parameters

    def use_lora(self, params: SamplingParams) -> None:
        """Run the next forward with the request's LoRA adapter (part of every key), or none."""
        if self.loras is not None:
            self.loras.activate(params.lora)

    def _progress_kwargs(self, batch: RequestBatch, params: SamplingParams) -> dict[str, Any]:
        """A step-end callback that reports progress and stops the forward once nobody
        wants it (`interrupt`), so an abandoned batch frees the accelerator within a step."""
        report, interrupt = self.progress_callback, self.interrupt
        if report is None and interrupt is None:
            return {}
        # Some pipelines take no step callback (HunyuanVideo 1.5): no progress, no early stop.
        if "callback_on_step_end" not in inspect.signature(self.pipe.__call__).parameters:
            return {}
        request_ids, total = batch.request_ids, resolved(params.num_inference_steps)

        def on_step_end(pipe: Any, step: int, timestep: Any, tensors: dict[str, Any]) -> dict[str, Any]:
            if interrupt is not None and interrupt.is_set():
                raise ForwardInterrupted
            if report is not None:
                report(request_ids, step + 1, total)
            return tensors

        return {"callback_on_step_end": on_step_end}

    # Step level: `pipelines.stepping.stages` -------------------------------------------------

    def prepare(self, requests: list[GenerationRequest]) -> list[Any]:
        return stages.prepare(self, requests)

    def step(self, states: list[Any]) -> None:
        stages.step(self, states)

    def finish(self, states: list[Any]) -> list[RequestOutput]:
        return stages.finish(self, states)

    def preview(self, states: list[Any]) -> list[tuple[Any, ...]]:
        return stages.preview(self, states)

    def _latent_grid(self, states: list[Any], latents: torch.Tensor) -> torch.Tensor | None:
        return self.family.latent_grid(states, latents)
