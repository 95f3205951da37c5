"""The generic adapter: any diffusers text-to-image pipeline that no family file serves,
loaded with `DiffusionPipeline.from_pretrained` and served request-level.

What the pipeline's call accepts is read from its signature at start
(`pipelines.generic_call.CallSignature`): it batches requests through prompt lists (one
generator per image, so each request gets its own image) where the call takes lists, and
runs one request per forward where it does not; the log says which. Arguments the call does
not take are not passed, and a request that sets one is refused with 400 naming the field.
A class that cannot run here (a package it needs is missing, it wants an input image) fails
at start with the class and the reason (`GenericPipelineError`).
"""

from __future__ import annotations

import logging
import math
from typing import Any, ClassVar, Self

import numpy as np
import torch
from diffusers import DiffusionPipeline

from engine.request import (
    BatchKey,
    GenerationRequest,
    InvalidRequestError,
    RequestBatch,
    RequestOutput,
    SamplingParams,
)
from pipelines.adapter import DiffusersAdapter
from pipelines.base import PipelineConfig
from pipelines.families.base import Family, TaskUse
from pipelines.families.policies import CLASSIFIER_FREE_ZEROED, Guidance, Sizes
from pipelines.generic_call import CallSignature
from pipelines.loading import diffusers_class_name, load_diffusers, resolve_model_path
from pipelines.outputs import split_outputs, to_arrays
from pipelines.request_level import progress_kwargs
from pipelines.schedule import timesteps_kwargs

logger = logging.getLogger(__name__)


class GenericPipelineError(ValueError):
    """A diffusers pipeline class the generic adapter cannot serve on this machine."""

    def __init__(self, class_name: str, reason: str) -> None:
        super().__init__(f"{class_name} cannot be served here: {reason}")
        self.class_name = class_name
        self.reason = reason


def pipeline_class(class_name: str) -> type:
    """The diffusers class named `class_name`, or `GenericPipelineError` saying why it cannot be
    used here: not a diffusers class, or one whose packages are missing (diffusers puts a
    placeholder that names them in their stead)."""
    import diffusers
    from diffusers.utils import DummyObject

    cls = getattr(diffusers, class_name, None)
    if not isinstance(cls, type) or not issubclass(cls, DiffusionPipeline):
        if isinstance(cls, DummyObject):
            backends = ", ".join(missing_backends(getattr(cls, "_backends", ())))
            raise GenericPipelineError(class_name, f"it needs packages not installed here: {backends}")
        raise GenericPipelineError(
            class_name,
            f"diffusers {diffusers.__version__} has no pipeline class of that name (a custom adapter "
            "can be given as pipeline_class='module:Class')"
            if cls is None
            else "it is not a diffusers pipeline class",
        )
    return cls


def missing_backends(backends: tuple[str, ...] | list[str]) -> list[str]:
    """Those of a placeholder's packages that are missing, as diffusers' own check tells."""
    from diffusers.utils.import_utils import BACKENDS_MAPPING

    return [name for name in backends if name in BACKENDS_MAPPING and not BACKENDS_MAPPING[name][0]()]


def _default_size(pipe: Any) -> tuple[int, int]:
    """The call's own default size, else its denoiser's sample size in pixels, as diffusers'
    pipelines derive theirs."""
    defaults = CallSignature.of(type(pipe)).defaults
    if isinstance(defaults.get("width"), int) and isinstance(defaults.get("height"), int):
        return int(defaults["width"]), int(defaults["height"])
    scale = int(getattr(pipe, "vae_scale_factor", 8))
    sample = getattr(pipe, "default_sample_size", None)
    if sample is None:
        denoiser = getattr(pipe, "transformer", None) or getattr(pipe, "unet", None)
        sample = getattr(getattr(denoiser, "config", None), "sample_size", None)
    side = int(sample) * scale if isinstance(sample, int) else 1024
    return side, side


def _size_multiple(pipe: Any) -> int:
    # Latents are the image over the VAE's scale, in patches where the transformer packs
    # them; 8 is what every UNet-era check_inputs asks at least.
    scale = int(getattr(pipe, "vae_scale_factor", 8))
    denoiser = getattr(pipe, "transformer", None) or getattr(pipe, "unet", None)
    patch = getattr(getattr(denoiser, "config", None), "patch_size", None)
    return math.lcm(8, scale * (patch if isinstance(patch, int) else 1))


class GenericFamily(Family):
    """A family known only through its diffusers call: request-level, its call's defaults."""

    key_name: ClassVar[str] = "generic"
    # A missing negative prompt is not an empty one in every pipeline (SDXL zeroes it), so
    # requests with and without one never share a call.
    guidance: ClassVar[Guidance] = CLASSIFIER_FREE_ZEROED
    sizes: ClassVar[Sizes] = Sizes(default=_default_size, multiple=_size_multiple)

    def __init__(self, pipe: DiffusionPipeline, config: PipelineConfig, use: TaskUse) -> None:
        super().__init__(pipe, config, use)
        self.signature = CallSignature.of(type(pipe))

    def key_extras(self, params: SamplingParams) -> tuple[Any, ...]:
        # A call that takes one negative prompt (a string, not a list) needs it equal.
        if self.signature.accepts("negative_prompt") and not self.signature.negative_prompt_lists:
            return (params.negative_prompt,)
        return ()

    def call_kwargs(self, params: SamplingParams) -> dict[str, Any]:
        return {"guidance_scale": params.guidance_scale} if self.signature.accepts("guidance_scale") else {}

    def validate(self, params: SamplingParams) -> None:
        signature = self.signature
        if params.negative_prompt and not signature.accepts("negative_prompt"):
            raise InvalidRequestError("negative_prompt is not supported by this model", "negative_prompt")
        if params.guidance_scale is not None and not signature.accepts("guidance_scale"):
            raise InvalidRequestError("guidance_scale is not supported by this model", "guidance_scale")
        fixed_size = not (signature.accepts("height") and signature.accepts("width"))
        if fixed_size and (params.width, params.height) != self.default_size():
            raise InvalidRequestError("this model makes images of its default size only", "size")


class GenericAdapter(DiffusersAdapter):
    """Serves a diffusers text-to-image pipeline class that has no family, request-level."""

    # Not `family=` in the class line: that composes a use and sets the batching flags as
    # class attributes, and here they are read from the loaded pipeline's call.
    family_class: ClassVar[type[Family]] = GenericFamily
    family: GenericFamily

    def __init__(self, pipe: DiffusionPipeline, config: PipelineConfig) -> None:
        super().__init__(pipe, config)
        defaults = self.signature.defaults
        # The call's own defaults, where neither the config nor the family base says better.
        if config.default_steps is None:
            self.steps = int(defaults.get("num_inference_steps") or self.steps)
        if config.default_guidance_scale is None:
            guidance = defaults.get("guidance_scale")
            self.guidance_scale = float(guidance) if isinstance(guidance, (int, float)) else None

    @classmethod
    def load(cls, config: PipelineConfig, class_name: str | None = None) -> Self:
        """Load with `DiffusionPipeline.from_pretrained`, after checking that the class can run
        a text-to-image request here; `class_name` is the model index's (read if not given)."""
        if class_name is None:
            class_name = diffusers_class_name(resolve_model_path(config.model))
        signature = CallSignature.of(pipeline_class(class_name))
        if signature.refusal is not None:
            raise GenericPipelineError(class_name, signature.refusal)
        try:
            pipe = load_diffusers(config)
        except ImportError as exc:  # a component's package (diffusers names it)
            raise GenericPipelineError(class_name, str(exc).strip()) from exc
        adapter = cls(pipe, config)
        logger.info(
            "%s has no family: served request-level by the generic adapter, which %s",
            class_name,
            signature.describe(),
        )
        return adapter

    @property
    def signature(self) -> CallSignature:
        return self.family.signature

    @property
    def supports_request_batch(self) -> bool:  # type: ignore[override]
        return self.signature.batches

    @property
    def supports_step_batch(self) -> bool:  # type: ignore[override]
        return False

    def batch_key(self, request: GenerationRequest) -> BatchKey:
        return ("generic", *super().batch_key(request)[1:])

    def forward(self, batch: RequestBatch) -> list[RequestOutput]:
        if self.signature.batches:
            return self._call(batch)
        return [self._alone(request) for request in batch.requests]

    def _call(self, batch: RequestBatch) -> list[RequestOutput]:
        """One call for the whole batch: each request's n as repeated prompts, one generator
        per image."""
        shared = batch.requests[0].params  # every key field is equal across the batch
        owners = [(request, seed) for request in batch.requests for seed in request.params.image_seeds()]
        kwargs: dict[str, Any] = {
            "prompt": [request.prompt for request, _ in owners],
            "generator": [torch.Generator("cpu").manual_seed(seed) for _, seed in owners],
        }
        if shared.negative_prompt:  # in the key: every request has one, or none does
            negatives = [request.params.negative_prompt for request, _ in owners]
            kwargs["negative_prompt"] = negatives if self.signature.negative_prompt_lists else negatives[0]
        images = self._run(batch, shared, kwargs)
        return split_outputs(batch, images)

    def _alone(self, request: GenerationRequest) -> RequestOutput:
        """A call per image, for a call that takes one prompt and one generator."""
        params, images = request.params, []
        single = RequestBatch(key=(), requests=(request,))
        for seed in params.image_seeds():
            kwargs: dict[str, Any] = {
                "prompt": request.prompt,
                "generator": torch.Generator("cpu").manual_seed(seed),
            }
            if params.negative_prompt:
                kwargs["negative_prompt"] = params.negative_prompt
            images.extend(self._run(single, params, kwargs))
        return RequestOutput(request.request_id, tuple(images), tuple(params.image_seeds()))

    def _run(self, batch: RequestBatch, shared: SamplingParams, kwargs: dict[str, Any]) -> list[np.ndarray]:
        latent = shared.output_type == "latent"
        wanted = {
            "num_inference_steps": shared.num_inference_steps,
            "height": shared.height,
            "width": shared.width,
            "num_images_per_prompt": 1,
            "output_type": "latent" if latent else "np",
            **timesteps_kwargs(self.config),
            **self.family.call_kwargs(shared),
        }
        if self.signature.accepts("callback_on_step_end"):
            wanted.update(progress_kwargs(self, batch, shared))
        kwargs.update({name: value for name, value in wanted.items() if self.signature.accepts(name)})
        self.use_lora(shared)
        with torch.inference_mode():
            result = self.pipe(**kwargs)
        images = result.images
        if not latent and not isinstance(images, np.ndarray | torch.Tensor):  # PIL: no "np" output
            images = [np.asarray(image, dtype=np.float32) / 255.0 for image in images]
        return to_arrays(images, shared.output_type)
