"""The family contract: one network and how it runs, whatever the task.

A family instance is "this network, loaded for one use": it holds the diffusers pipeline,
the config, the device its inputs go to (read once), its size multiple and the lock every
VAE call takes. Its class says which tasks it serves (`uses`, one `TaskUse` line each), its
defaults, and how it guides and sizes images (`pipelines.families.policies`). Its step
hooks (encode, schedule, noise, denoise, merge, guide, decode, and the primitives the
input-image tasks call, `pipelines.families.input_primitives`) are what
`pipelines.adapter.DiffusersAdapter` and the tasks drive; its cache-acceleration hooks
(`pipelines.families.cache_hooks`) are what `pipelines.cache` reads.

This base is also the generic family: request-level only (`steps()` is False), with
diffusers' usual `__call__` defaults, which is what serves a `DiffusersTextToImage` subclass.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from diffusers import DiffusionPipeline
from torch import Tensor

from engine.request import GenerationRequest, SamplingParams
from pipelines.base import PipelineConfig
from pipelines.families.cache_hooks import CacheHooks
from pipelines.families.input_primitives import InputPrimitives
from pipelines.families.policies import CLASSIFIER_FREE, UNET, Guidance, Sizes, video_sizes
from pipelines.loading import load_diffusers
from pipelines.stepping.state import Conditioning, DenoiseState, Encoded, classifier_free, concatenate
from pipelines.tasks.base import TEXT_TO_IMAGE, Task


@dataclass(frozen=True)
class TaskUse:
    """One task a family serves, and the diffusers pipeline that runs it (a model index
    naming that class selects this use)."""

    task: Task
    diffusers_class: str
    # The composed adapter's name; by default the family's name and the task's suffix.
    name: str | None = None
    # Input images a request brings (min, max), where it differs from the task's.
    images: tuple[int, int] | None = None
    request_batch: bool = True
    # One diffusers call per generated image (a pipeline that refuses batches of prompts).
    one_image_per_call: bool = False
    # False where the family's stages do not cover this use: request-level only.
    stepped: bool = True
    # Replaces diffusers' loader: (path, dtype) -> pipeline.
    loader: Callable[[str, torch.dtype], DiffusionPipeline] | None = None


class Family(CacheHooks, InputPrimitives):
    # Two groups of hooks come from their own modules, one concern each (cache acceleration,
    # the input-media tasks' primitives); a family overrides them as any other hook.
    uses: ClassVar[tuple[TaskUse, ...]] = ()
    # What the step key starts with.
    key_name: ClassVar[str] = "diffusers"
    # Defaults when neither the request nor the config sets them (the family's diffusers
    # `__call__` defaults).
    default_steps: ClassVar[int] = 50
    default_guidance_scale: ClassVar[float | None] = 7.5
    default_true_cfg_scale: ClassVar[float | None] = None
    guidance: ClassVar[Guidance] = CLASSIFIER_FREE
    sizes: ClassVar[Sizes] = UNET
    # Video families.
    default_fps: ClassVar[int] = 16
    default_num_frames: ClassVar[int] = 81
    # Noised as flow matching does (`scale_noise`), else `add_noise`.
    flow_matching: ClassVar[bool] = False
    # Whether `scheduler()` sets a config's fixed timesteps (`PipelineConfig.timesteps`) on
    # each request's scheduler copy; if not, such a config is served request-level.
    fixed_timesteps: ClassVar[bool] = False
    # Its inpainting pipeline samples the input's latents (from the generators) even where
    # its denoiser reads the mask and starts from noise alone (FLUX Fill at strength 1).
    samples_input_latents: ClassVar[bool] = False

    def __init__(self, pipe: DiffusionPipeline, config: PipelineConfig, use: TaskUse) -> None:
        self.pipe = pipe
        self.config = config
        self.use = use
        # Where inputs go, read once: diffusers' `_execution_device` walks every submodule
        # of every component looking for offload hooks, ~5 ms per read on tiny Qwen-Image
        # and more on a real model, and the step stages need it for every joiner.
        self.device: torch.device = pipe._execution_device
        self.size_multiple = config.size_multiple or self.sizes.multiple(pipe)
        # `finish` may run on a decode thread beside the stepping thread: every VAE call
        # holds this lock, as VAEs keep per-call caches (Wan's and Qwen-Image's causal
        # convolutions clear and fill a feature cache on each encode and decode).
        self.vae_lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        # Locks do not pickle (`spec()` crosses to another process); a copy gets its own.
        state = dict(self.__dict__)
        state.pop("vae_lock", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.vae_lock = threading.Lock()

    @classmethod
    def use_for(cls, diffusers_class: str) -> TaskUse:
        for use in cls.uses:
            if use.diffusers_class == diffusers_class:
                return use
        raise ValueError(f"{cls.__name__} serves no {diffusers_class}")

    @classmethod
    def load_pipe(cls, use: TaskUse, config: PipelineConfig) -> DiffusionPipeline:
        """The configured weights in the diffusers pipeline of `use`: as their model index
        says, or, for the tasks that run their own pipeline class over text-to-image
        weights, that class over the components exactly as loaded (`share_components`)."""
        return load_diffusers(config, use.loader, run_as=use.diffusers_class if use.task.from_pipe else None)

    def default_size(self) -> tuple[int, int]:
        return self.sizes.default(self.pipe)

    def size_from_image(self, image: Any) -> tuple[int, int] | None:
        """(width, height) an image-to-video request makes from its input image (HxWx3 uint8)
        where the family's pipeline sizes the video by it; None where the request's size holds."""
        return None

    def frame_step(self) -> int:
        """Frame counts must be `frame_step * k + 1` (the VAE's temporal compression)."""
        return int(self.pipe.vae_scale_factor_temporal)

    def two_experts(self) -> bool:
        """Whether the weights are two denoisers split at a boundary timestep (Wan 2.2 A14B),
        each with its guidance scale (`guidance_scale_2` for the second)."""
        return False

    def complete(self, params: SamplingParams) -> SamplingParams:
        """Parameters after the adapter's defaults, with the family's own filled in."""
        return params

    # Request level ------------------------------------------------------------------------

    def validate(self, params: SamplingParams) -> None:
        """Raise `InvalidRequestError` for what the family cannot run."""

    def key_extras(self, params: SamplingParams) -> tuple[Any, ...]:
        return ()

    def call_kwargs(self, params: SamplingParams) -> dict[str, Any]:
        """The guidance arguments of the diffusers call, and any other of the family's."""
        return self.guidance.call_kwargs(params)

    def call_inputs(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """The prompts, negative prompts and generators of a call (lists) as the pipeline
        takes them."""
        return inputs

    def extras_of(self, result: Any) -> dict[str, list[Any]]:
        """Other per-image outputs (LTX-2's audio): name -> one entry per generated image."""
        return {}

    # Step level -----------------------------------------------------------------------------

    def steps(self) -> bool:
        """Whether these weights run in the family's stages (read live: a config can say
        no, and a test changes it after loading)."""
        return False

    def step_key_extras(self, params: SamplingParams) -> tuple[Any, ...]:
        return ()

    def context_tokens(self, request: GenerationRequest) -> int:
        """Tokens a row carries into the denoiser's attention besides its latents, where they
        are many whatever the size (HunyuanVideo 1.5's ~2,000 text and image tokens), in the
        units of `step_cost` (one latent token); 0 where the latents dominate."""
        return 0

    def uses_cfg(self, request: GenerationRequest) -> bool:
        """Whether a request has negative rows in a step, as the family's diffusers call
        decides it (`Guidance.uses_cfg`)."""
        return self.guidance.uses_cfg(request.params)

    def passes(self, request: GenerationRequest) -> int:
        """The denoiser rows each of a request's images takes in one step, for its step cost:
        2 with classifier-free guidance (its negative row), else 1; more in a family that runs
        extra guidance passes (LTX-2's perturbed and isolated ones)."""
        return 2 if self.uses_cfg(request) else 1

    def encode(self, requests: list[GenerationRequest], task: Task) -> list[Encoded]:
        """Every joiner's conditioning, in one text-encoder call where the family allows."""
        raise NotImplementedError(f"{type(self).__name__} does not step")

    def scheduler(self, request: GenerationRequest) -> Any:
        """A copy of the pipeline's scheduler with the request's timesteps set."""
        raise NotImplementedError(f"{type(self).__name__} does not step")

    def noise(
        self,
        request: GenerationRequest,
        scheduler: Any,
        generators: list[torch.Generator],
        cond: Conditioning,
    ) -> Tensor:
        """A text-to-X request's start latents, from its own generators."""
        raise NotImplementedError(f"{type(self).__name__} does not step")

    def state(
        self,
        request: GenerationRequest,
        scheduler: Any,
        latents: Tensor,
        generators: list[torch.Generator],
        prompts: Encoded,
        *,
        first_step: int = 0,
    ) -> DenoiseState:
        """The request at its first step, guided by its guidance scale."""
        params = request.params
        scale = params.true_cfg_scale if self.guidance.true_cfg else params.guidance_scale
        if scale is None:
            raise RuntimeError("sampling parameters were not resolved before use")
        return DenoiseState.start(
            request,
            scheduler,
            latents,
            prompts=prompts,
            guidance_scale=scale,
            generators=generators,
            first_step=first_step,
        )

    def denoise(self, states: list[Any], latents: Tensor, timesteps: Tensor, cond: Conditioning) -> Tensor:
        """One denoiser forward over the merged rows of `states`, each at its own timestep."""
        raise NotImplementedError(f"{type(self).__name__} does not step")

    def merge(self, conds: list[Conditioning]) -> Conditioning:
        return concatenate(conds)

    def guide(self, state: DenoiseState, uncond: Tensor, cond: Tensor) -> Tensor:
        return classifier_free(uncond, cond, state.guidance_scale)

    def decode(self, states: list[Any], latents: Tensor) -> Any:
        """Latents of finished requests (one size) to float images in [0, 1], HxWx3 numpy;
        the caller holds `vae_lock`."""
        raise NotImplementedError(f"{type(self).__name__} does not step")

    def decode_extras(self, states: list[Any], latents: Tensor) -> dict[str, list[Any]]:
        """Other per-image outputs of a step-level decode, as `extras_of` gives them at
        request level (LTX-2's audio); the caller holds `vae_lock`."""
        return {}

    def latent_grid(self, states: list[Any], latents: Tensor) -> Tensor | None:
        """Latents as (B, C, h, w), one vector per latent pixel, for the linear preview; None
        where the family has no such view (video)."""
        return latents if latents.ndim == 4 else None


GENERIC_TEXT_TO_IMAGE = TaskUse(TEXT_TO_IMAGE, "")


class GenericVideo(Family):
    """The generic family for text-to-video: Wan's `__call__` defaults."""

    sizes: ClassVar[Sizes] = video_sizes((832, 480), 16)
