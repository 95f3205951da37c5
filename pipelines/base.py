"""The contract between the engine and a model: what every pipeline adapter provides.

Torch-free on purpose, so the server and the engine can name these types without
importing a deep-learning stack.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Protocol, Self

from engine.request import (
    BatchKey,
    CacheChoice,
    ControlRef,
    GenerationRequest,
    InvalidRequestError,
    IPAdapterRef,
    Moderation,
    RequestBatch,
    RequestOutput,
    SamplingParams,
)
from pipelines.denoiser.options import DenoiserConfig
from pipelines.family_options import FamilyOptions
from pipelines.memory.options import MemoryConfig
from pipelines.parallel.seat import LaneSeat

# "image+edit": both image endpoints (FLUX.2: references optional).
Modality = Literal["image", "video", "edit", "image+edit"]

# Called from `forward` after each denoising step: (request ids of the batch, steps done, total).
ProgressCallback = Callable[[list[str], int, int], None]


@dataclass(frozen=True, slots=True)
class PipelineConfig:
    """Which model to serve and how to place it.

    `model`: an embedded `tiny-*` name, a local diffusers directory, or a hub id.
    `pipeline_class`: `module:Class` of a custom `Pipeline` subclass, overriding the
    registry's choice. `dtype`: `auto` (bfloat16 on GPU, float32 on CPU), `float32`,
    `float16` or `bfloat16`. `default_*` override the model's own defaults; `max_pixels`
    bounds width x height. `scheduler` replaces the model's scheduler with that diffusers class
    (built from the model's scheduler config); `timesteps`, if any, are the fixed timesteps
    every request runs (a distilled model's: DMD2's 999, 749, 499, 249), so every request
    takes that many steps (`pipelines.schedule`). `preview_decoder` turns `partial_images`
    previews into pixels: `vae` (the model's own decode) or `linear` (a latent-to-RGB map fitted on the final
    decodes, `pipelines.stepping.preview`). `max_request_work` bounds n x frames x width x height x
    steps of one request (`pipelines.work`; None = 16 times the model's default request).
    `lora_modules`: (name, source) of the LoRA adapters requests may apply (a local file or
    directory, a hub id, or an embedded `tiny-lora-<n>`), at most `max_loras` loaded at once.
    `controlnets`: (name, source) of the ControlNets loaded beside the model (a local
    directory, a hub id, or an embedded tiny one: `tiny-sd-controlnet`, `tiny-sdxl-controlnet`,
    `tiny-sdxl-controlnet-union`, `tiny-flux-controlnet`, `tiny-flux-controlnet-union`).
    `ip_adapters`: (name, source) of the IP-Adapters loaded beside the model (a weights file,
    local or `owner/repo/folder/file` on the hub, or the embedded `tiny-sd-ip-adapter`,
    `tiny-sdxl-ip-adapter` or `tiny-flux-ip-adapter`).
    `memory`: per-component dtypes, offload, quantized weights and the decode budget
    (`pipelines.memory`). `options`: family call settings over the pipeline's defaults
    (`pipelines.family_options`). `prompt_cache_mb` bounds the prompt-embedding cache
    (`pipelines.prompt_cache`; 0 = none: the server's `--prompt-cache-mb` sets it).
    `cache`: the cache acceleration of requests that choose none. `denoiser`: compiled or
    not, and its attention backend (`pipelines.denoiser`).
    """

    model: str = "tiny-sd"
    device: str = "cpu"
    dtype: str = "auto"
    pipeline_class: str | None = None
    default_size: tuple[int, int] | None = None
    default_steps: int | None = None
    default_guidance_scale: float | None = None
    default_guidance_scale_2: float | None = None
    default_true_cfg_scale: float | None = None
    default_negative_prompt: str | None = None
    size_multiple: int | None = None
    scheduler: str | None = None
    timesteps: tuple[int, ...] = ()
    max_pixels: int = 2048 * 2048
    num_threads: int | None = None
    preview_decoder: Literal["vae", "linear"] = "linear"
    max_request_work: int | None = None
    lora_modules: tuple[tuple[str, str], ...] = ()
    max_loras: int = 4
    # (name, source) of the ControlNets requests may use (`--controlnet`, `pipelines.controlnet`).
    controlnets: tuple[tuple[str, str], ...] = ()
    # (name, source) of the IP-Adapters requests may use (`--ip-adapter`, `pipelines.ip_adapter`).
    ip_adapters: tuple[tuple[str, str], ...] = ()
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    options: FamilyOptions = field(default_factory=FamilyOptions)
    prompt_cache_mb: float = 0.0
    # Cache acceleration for requests that choose none (`--cache`, `pipelines.cache`), and
    # the threshold of a request that names first-block without one (`--cache-threshold`,
    # kept apart: a TaylorSeer default `cache` has none; None: `cache`'s, else 0.1).
    cache: CacheChoice = field(default_factory=CacheChoice)
    cache_threshold: float | None = None
    denoiser: DenoiserConfig = field(default_factory=DenoiserConfig)
    # The image safety classifier every image is checked with (`--safety-checker`,
    # `pipelines.safety`); None: nothing is checked.
    safety_checker: str | None = None
    # Subnormal floats flushed to zero on CPU in the threads that run the pipeline
    # (`pipelines.float_modes`; `--flush-denormal`).
    flush_denormal: bool = True
    # This worker's seat in a lane of several devices (`--cfg-parallel`, `--sequence-parallel`,
    # `pipelines.parallel`); None: the lane is this one device.
    lane: LaneSeat | None = None
    # Requests of different sizes may step in one forward where the family pads them
    # (`Family.mixes_sizes_for`; `--mix-sizes`); False: one step group per size.
    mix_sizes: bool = True
    # Where the family packs them end to end (`Family.packs_sizes_for`) rather than padding
    # them to one grid; False (`--mix-sizes pad`): always the grid.
    pack_sizes: bool = True


def refuse_unserved(names: Sequence[str], served: Sequence[str], kind: str, field: str) -> None:
    """Refuse a conditioning model (`kind`: "ControlNet", "IP-Adapter") a request names but
    this pipeline does not serve: a 400 naming `field[i].name`, with the names it serves."""
    for index, name in enumerate(names):
        if name not in served:
            known = ", ".join(repr(one) for one in served) or "none"
            raise InvalidRequestError(
                f"the {kind} {name!r} is not served with this model; served: {known}",
                f"{field}[{index}].name",
            )


class ImageSafetyChecker(Protocol):
    """What judges a pipeline's images (`pipelines.safety.SafetyChecker`)."""

    def flags(self, images: list[tuple[Any, ...]], levels: list[Moderation]) -> list[bool]:
        """For each request's images (uint8 HxWx3, or FxHxWx3 video frames), whether any is
        flagged at that request's level."""
        ...


class Pipeline(ABC):
    """One loaded model behind the engine.

    `resolve`, `validate` and `batch_key` are pure and cheap: the engine calls them on its
    event loop at admission. `forward` is the heavy call, made from one executor thread
    only, with a batch whose requests all share one `batch_key`. It must return exactly
    one `RequestOutput` per request, in batch order, each with `params.n` images.
    """

    supports_request_batch: ClassVar[bool] = False
    # Step-level batching: the pipeline runs its own denoising loop in stages (`prepare`,
    # `step`, `finish`) so requests can join and leave between steps.
    supports_step_batch: ClassVar[bool] = False
    modality: ClassVar[Modality] = "image"
    # How many input images a request must bring (min, max), and whether it may bring a mask:
    # (0, 0) for text-to-image and text-to-video, (1, 1) for image edits and image-to-video.
    input_image_count: ClassVar[tuple[int, int]] = (0, 0)
    accepts_mask: ClassVar[bool] = False
    # Whether a request may bring a control video (Wan VACE).
    accepts_control_video: ClassVar[bool] = False
    # Set by the executor after loading; `forward` reports denoising progress through it.
    progress_callback: ProgressCallback | None = None
    # Set by the executor: when it is set during a forward, the forward raises
    # `ForwardInterrupted` at its next denoising step (every request of the batch is gone).
    interrupt: threading.Event | None = None
    # Set by the composition root where the server has `--safety-checker`: what `moderate`
    # judges the images with (any pipeline, a custom one too, is checked the same way).
    safety_checker: ImageSafetyChecker | None = None

    @classmethod
    @abstractmethod
    def load(cls, config: PipelineConfig) -> Self: ...

    @abstractmethod
    def resolve(self, request: GenerationRequest) -> SamplingParams:
        """The request's parameters with the model's defaults filled into the fields left
        `None` (the seed excepted); input images may decide some (an edit's size)."""

    @abstractmethod
    def validate(self, params: SamplingParams) -> None:
        """Raise `InvalidRequestError` naming the field if resolved `params` cannot run."""

    def validate_inputs(self, num_images: int, has_mask: bool) -> None:
        """Raise `InvalidRequestError` if a request's input images or mask do not fit."""
        low, high = self.input_image_count
        if not low <= num_images <= high:
            count = "no" if high == 0 else f"{low}" if low == high else f"{low} to {high}"
            raise InvalidRequestError(
                f"this model takes {count} input image{'s' if high > 1 else ''}, got {num_images}",
                "input_images",
            )
        if has_mask and not self.accepts_mask:
            raise InvalidRequestError("this model takes no mask", "mask")

    def validate_controls(self, controls: tuple[ControlRef, ...]) -> None:
        """Raise `InvalidRequestError` naming `controlnet[i].name` for a ControlNet this
        pipeline does not serve; by default it serves none."""
        if controls:
            raise InvalidRequestError(
                f"the ControlNet {controls[0].name!r} is not served with this model", "controlnet[0].name"
            )

    def validate_ip_adapters(self, refs: tuple[IPAdapterRef, ...], params: SamplingParams) -> None:
        """Raise `InvalidRequestError` naming `ip_adapter[i].name` for an IP-Adapter this
        pipeline does not serve; by default it serves none."""
        if refs:
            raise InvalidRequestError(
                f"the IP-Adapter {refs[0].name!r} is not served with this model", "ip_adapter[0].name"
            )

    def reduce_inputs(self, request: GenerationRequest) -> GenerationRequest:
        """The request (parameters resolved) with its input images reduced to what the model
        will use of them, so a queued request holds no more than that. Called off the event
        loop at admission; the output must not change (resize only where the pipeline would
        resize the same way). By default unchanged."""
        return request

    @abstractmethod
    def batch_key(self, request: GenerationRequest) -> BatchKey:
        """Everything that must be equal for two requests (parameters resolved) to share one forward."""

    @abstractmethod
    def forward(self, batch: RequestBatch) -> list[RequestOutput]: ...

    # Step-level stages, for pipelines with `supports_step_batch`. States are the
    # pipeline's own objects (latents, scheduler copy, encoded prompt), held by the
    # executor between calls; each has `steps_done`, `total_steps`, `is_done` and
    # `num_images`. All three are called from the executor thread only.

    def spec(self) -> Pipeline:
        """This pipeline's pure calls (`resolve`, `validate`, keys, costs, `reduce_inputs`)
        as a picklable object without weights: what a worker process sends the engine's
        process, which admits requests with it. By default the pipeline itself."""
        return self

    def close(self) -> None:
        """Release what the pipeline holds outside this process's memory (its offload files
        on disk); called when its executor shuts down. By default nothing."""
        return None

    def step_key(self, request: GenerationRequest) -> BatchKey:
        """What requests stepping in one denoiser forward must share (the latent shape, the
        weights); steps, guidance and negative prompt are per request and stay out."""
        raise NotImplementedError(f"{type(self).__name__} does not support step-level batching")

    def step_cost(self, request: GenerationRequest) -> int:
        """What the request adds to one denoiser step, for the step scheduler's compute budget:
        rows x latent tokens, i.e. n x (width / 8) x (height / 8) x latent frames (a latent
        frame per 4 video frames). Families with classifier-free guidance double the rows of
        requests that use it."""
        return request.params.n * latent_units(request.params)

    def step_grid(self, request: GenerationRequest) -> tuple[int, ...]:
        """The token grid of the request's rows where its step key leaves the size out (rows
        of different sizes stepping in one forward, padded to the grid holding them all);
        () where the step key fixes the size, as by default."""
        return ()

    def step_packs(self, request: GenerationRequest) -> bool:
        """Whether the request's rows are packed end to end beside rows of other sizes
        (`PipelineSpec.step_packs`); not by default."""
        return False

    def stage_timer(self) -> Any:
        """What times the stages on this pipeline's device (`engine.worker.timing.StageTimer`: CUDA
        events on a GPU, `pipelines.timing`), or None where the host's clock is right: a
        device that runs each call to its end (the CPU)."""
        return None

    def prepare(self, requests: list[GenerationRequest]) -> list[Any]:
        """Encode each request and draw its initial latents: one state per request, in order."""
        raise NotImplementedError(f"{type(self).__name__} does not support step-level batching")

    def step(self, states: list[Any]) -> None:
        """Advance every state by one denoising step, in one denoiser forward. If it raises,
        no state may have changed (the engine retries each request alone)."""
        raise NotImplementedError(f"{type(self).__name__} does not support step-level batching")

    def finish(self, states: list[Any]) -> list[RequestOutput]:
        """Decode states that took their last step: one output per state, in order."""
        raise NotImplementedError(f"{type(self).__name__} does not support step-level batching")

    def preview(self, states: list[Any]) -> list[tuple[Any, ...]]:
        """Decode the states' `preview` latents (a clean estimate, for `partial_images`): one
        tuple of n uint8 images per state, in order."""
        raise NotImplementedError(f"{type(self).__name__} does not support step-level batching")

    # What the pipeline counts as it runs (`engine.worker.forward.PipelineCounters`): running
    # totals the engine reads around each forward and step for `/metrics`. By default it
    # counts nothing; the adapters count what their parts do (`pipelines.adapter`).

    def prompt_cache_counts(self) -> dict[str, float] | None:
        """Its prompt-embedding cache's counts (hits, misses, evictions, encode_seconds,
        bytes, entries), or None without one."""
        return None

    def cache_blocks_skipped(self) -> int:
        """Denoiser blocks its requests skipped under their cache so far."""
        return 0

    def decode_out_of_memory(self) -> int:
        """Decodes that ran out of memory and were retried in halves so far."""
        return 0

    def compiled_graphs(self) -> int:
        """Graphs its compiled denoiser has compiled so far."""
        return 0

    # Moderation (`engine.worker.moderation.ModeratedPipeline`): the worker checks the images
    # of a group of requests after they are decoded, before anything encodes them.

    def moderates(self) -> bool:
        """Whether it has a safety checker."""
        return self.safety_checker is not None

    def moderate(self, requests: list[GenerationRequest], images: list[tuple[Any, ...]]) -> list[bool]:
        """For each request, whether its images are flagged at its `moderation` level."""
        if self.safety_checker is None:
            return [False] * len(requests)
        return self.safety_checker.flags(images, [request.params.moderation for request in requests])


def latent_units(params: SamplingParams) -> int:
    """One output's latents in the step budget's unit (an 8x8 pixel patch of a latent frame,
    a latent frame per 4 video frames), whatever the family's own compression."""
    frames = 1 if params.num_frames is None else (params.num_frames - 1) // 4 + 1
    return max(1, (params.width or 0) // 8) * max(1, (params.height or 0) // 8) * frames
