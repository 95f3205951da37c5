"""Request-level adapter over a diffusers pipeline: the one base of every family (each in
its own file; it picks its guidance and size rules from `pipelines.policies`).

One diffusers call per batch: the batch's prompts and negative prompts as lists, each
request's n expanded into repeated prompts with one generator per image (never
`num_images_per_prompt` with a list: it pairs text masks with the wrong prompts in some
families), and the images split back per request in order.
"""

from __future__ import annotations

import copy
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
from pipelines.decode import decode_in_halves, out_of_memory_count
from pipelines.families.policies import CLASSIFIER_FREE, UNET, Guidance, Sizes
from pipelines.loading import load_diffusers, weightless
from pipelines.lora import LoraAdapters
from pipelines.outputs import resolved, split_outputs, to_arrays
from pipelines.work import DEFAULT_WORK_MULTIPLE, check_work, request_work, steps_for_quality

MAX_STEPS = 1000


class DiffusersTextToImage(Pipeline):
    supports_request_batch: ClassVar[bool] = True
    # Family defaults, used when neither the request nor the config sets them (the
    # defaults of the family's diffusers `__call__`).
    default_steps: ClassVar[int] = 50
    default_guidance_scale: ClassVar[float | None] = 7.5
    default_true_cfg_scale: ClassVar[float | None] = None
    # How the family guides (classifier-free or true CFG; whether having a negative prompt
    # is in the batch key) and sizes its images.
    guidance: ClassVar[Guidance] = CLASSIFIER_FREE
    sizes: ClassVar[Sizes] = UNET
    # Image families refuse video parameters; video families take them.
    accepts_frames: ClassVar[bool] = False
    # Only families that start from an input image take `strength`.
    accepts_strength: ClassVar[bool] = False
    # The diffusers argument for outputs per prompt, always 1 (n is expanded into prompts).
    per_prompt_argument: ClassVar[str] = "num_images_per_prompt"

    def __init__(self, pipe: DiffusionPipeline, config: PipelineConfig) -> None:
        self.pipe = pipe
        self.config = config
        # Where inputs go, read once: diffusers' `_execution_device` walks every submodule
        # of every component looking for offload hooks, ~5 ms per read on tiny Qwen-Image
        # and more on a real model, and the step stages need it for every joiner.
        self.device: torch.device = pipe._execution_device
        self.default_width, self.default_height = config.default_size or self.model_default_size()
        self.steps = config.default_steps or self.default_steps
        guidance = config.default_guidance_scale
        self.guidance_scale = self.default_guidance_scale if guidance is None else guidance
        self.size_multiple = config.size_multiple or self.model_size_multiple()
        self.loras: LoraAdapters | None = LoraAdapters(pipe, config)
        self.loras.check()
        # A decode that runs out of memory is retried in halves on the latents it was given,
        # so the forward (and its denoising) need not run again (`pipelines.decode`).
        decode_in_halves(getattr(pipe, "vae", None))

    @classmethod
    def load(cls, config: PipelineConfig) -> Self:
        return cls(load_diffusers(config), config)

    def decode_out_of_memory(self) -> int:
        """Decodes that ran out of memory and were halved so far (`engine.forward` reports
        them for `/metrics`)."""
        return out_of_memory_count(getattr(self.pipe, "vae", None))

    def spec(self) -> Self:
        # The adapter over a weightless copy of its diffusers pipeline: every pure call
        # reads configs only (sizes, the scheduler's timesteps, the VAE's frame step).
        shell = copy.copy(self)
        shell.pipe = weightless(self.pipe)
        shell.progress_callback = shell.interrupt = None
        shell.loras = None
        return shell

    # Family hooks ---------------------------------------------------------------------

    def model_default_size(self) -> tuple[int, int]:
        return self.sizes.default(self.pipe)

    def model_size_multiple(self) -> int:
        return self.sizes.multiple(self.pipe)

    def _uses_cfg(self, request: GenerationRequest) -> bool:
        """Whether a request has negative rows in a step, as the family's diffusers call
        decides it (`Guidance.uses_cfg`)."""
        return self.guidance.uses_cfg(request.params)

    def step_cost(self, request: GenerationRequest) -> int:
        cost = super().step_cost(request)
        return 2 * cost if self._uses_cfg(request) else cost  # negative rows too

    def guidance_kwargs(self, params: SamplingParams) -> dict[str, Any]:
        """The guidance arguments of the diffusers call."""
        return self.guidance.call_kwargs(params)

    def family_kwargs(self, params: SamplingParams) -> dict[str, Any]:
        """Any other family-specific arguments of the diffusers call (frames for video)."""
        return {}

    def input_kwargs(self, batch: RequestBatch) -> dict[str, Any]:
        """The batch's input images as the diffusers call wants them (none for text-to-X)."""
        return {}

    def size_kwargs(self, params: SamplingParams) -> dict[str, Any]:
        """The output size as the diffusers call takes it (image-to-image takes none: its
        input image, sent at the output size, sets it)."""
        return {"width": params.width, "height": params.height}

    def outputs_of(self, result: Any) -> Any:
        """The generated arrays in a diffusers pipeline output."""
        return result.images

    def extras_of(self, result: Any) -> dict[str, list[Any]]:
        """Other per-image outputs (LTX-2's audio): name -> one entry per generated image."""
        return {}

    # The Pipeline contract ------------------------------------------------------------

    def resolve(self, request: GenerationRequest) -> SamplingParams:
        params = request.params
        steps = self.steps if params.quality is None else steps_for_quality(self.steps, params.quality)
        defaults: dict[str, Any] = {
            "width": self.default_width,
            "height": self.default_height,
            "num_inference_steps": steps,
            "guidance_scale": self.guidance_scale,
            "true_cfg_scale": self.default_true_cfg_scale,
        }
        changes = {name: value for name, value in defaults.items() if getattr(params, name) is None}
        return replace(params, **changes) if changes else params

    def validate(self, params: SamplingParams) -> None:
        width, height = resolved(params.width), resolved(params.height)
        for name, value in (("width", width), ("height", height)):
            if value % self.size_multiple:
                raise InvalidRequestError(
                    f"{name} must be a multiple of {self.size_multiple} for this model, got {value}", name
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
        for name in ("num_frames", "fps", "duration_s"):
            if not self.accepts_frames and getattr(params, name) is not None:
                raise InvalidRequestError(f"{name} applies to video models; this model makes images", name)
        if params.true_cfg_scale is not None and self.default_true_cfg_scale is None:
            raise InvalidRequestError("true_cfg_scale is not supported by this model", "true_cfg_scale")
        if params.strength is not None and not self.accepts_strength:
            raise InvalidRequestError("strength is not supported by this model", "strength")
        served = dict(self.config.lora_modules)
        if params.lora is not None and params.lora.name not in served:
            known = ", ".join(sorted(served)) or "none"
            raise InvalidRequestError(f"unknown LoRA adapter {params.lora.name!r} (served: {known})", "model")

    def max_steps(self) -> int:
        """MAX_STEPS, or fewer where the scheduler has fewer training timesteps: with
        `steps_offset` 1, DDIM at 1000 steps of 1000 would index timestep 1000 (IndexError)."""
        config = getattr(self.pipe.scheduler, "config", {})
        train = config.get("num_train_timesteps") or MAX_STEPS
        return min(MAX_STEPS, int(train) - int(config.get("steps_offset") or 0))

    def default_params(self) -> SamplingParams:
        """What a request that sets nothing asks for (n = 1), the measure of the work budget."""
        return SamplingParams(
            width=self.default_width, height=self.default_height, num_inference_steps=self.steps
        )

    def batch_key(self, request: GenerationRequest) -> BatchKey:
        params = request.params
        # diffusers cannot vary guidance per sample inside one call, so it is in the key.
        has_negative = bool(params.negative_prompt) if self.guidance.negative_prompt_in_key else None
        return (
            "text-to-image",
            params.width,
            params.height,
            params.num_inference_steps,
            params.guidance_scale,
            params.true_cfg_scale,
            has_negative,
            params.output_type,
            params.lora,
        )

    def forward(self, batch: RequestBatch) -> list[RequestOutput]:
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
        negative_prompt = negatives if any(negatives) or not self.guidance.negative_prompt_in_key else None
        self.use_lora(shared)
        with torch.inference_mode():
            result = self.pipe(
                prompt=prompts,
                negative_prompt=negative_prompt,
                num_inference_steps=shared.num_inference_steps,
                generator=generators,
                output_type="latent" if shared.output_type == "latent" else "np",
                **{self.per_prompt_argument: 1},
                **self.guidance_kwargs(shared),
                **self.size_kwargs(shared),
                **self.family_kwargs(shared),
                **self.input_kwargs(batch),
                **self._progress_kwargs(batch, shared),
            )
        arrays = to_arrays(self.outputs_of(result), shared.output_type)
        return split_outputs(batch, arrays, self.extras_of(result))

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
        request_ids, total = batch.request_ids, resolved(params.num_inference_steps)

        def on_step_end(pipe: Any, step: int, timestep: Any, tensors: dict[str, Any]) -> dict[str, Any]:
            if interrupt is not None and interrupt.is_set():
                raise ForwardInterrupted
            if report is not None:
                report(request_ids, step + 1, total)
            return tensors

        return {"callback_on_step_end": on_step_end}
