"""The one adapter between the engine and a diffusers pipeline: a family (what the network
is, `pipelines.families`) composed with a task (what the request asks, `pipelines.tasks`).

It holds what a loaded model keeps (defaults settled at load, LoRA adapters, the prompt
cache, step mode's caches) and answers the `pipelines.base.Pipeline` contract by handing
each concept to its module: admission (`pipelines.admission`: defaults, checks, keys, step
cost), request level (`pipelines.request_level`: one diffusers call per batch), and step
level (`pipelines.step_level`: `prepare`, `step`, `finish`, `preview` around
`pipelines.stepping.state.step_together`, with the family's hooks and the task's recipe for
a request's first state).

The registry composes one subclass per (family, diffusers class) it serves
(`pipelines.registry.composed`); this class itself is the generic text-to-image adapter
(request level, diffusers' usual defaults).
"""

from __future__ import annotations

import copy
import inspect
from typing import Any, ClassVar, Self

import torch
from diffusers import DiffusionPipeline

from engine.request import (
    BatchKey,
    ControlRef,
    ForwardInterrupted,
    GenerationRequest,
    IPAdapterRef,
    RequestBatch,
    RequestOutput,
    SamplingParams,
)
from pipelines import admission, request_level, step_level
from pipelines.base import Pipeline, PipelineConfig, refuse_unserved
from pipelines.cache.block_hooks import RowFirstBlockCache
from pipelines.cache.choice import effective
from pipelines.cache.taylor_seer import RowTaylorSeer
from pipelines.controlnet import ControlNetSet, check_modes, reduced_controls
from pipelines.decode import decode_in_halves, out_of_memory_count
from pipelines.denoiser.compiling import compiled_graphs
from pipelines.families.base import GENERIC_TEXT_TO_IMAGE, Family, TaskUse
from pipelines.ip_adapter import IPAdapters, reduced_references
from pipelines.loading import weightless
from pipelines.lora import LoraAdapters
from pipelines.memory.loading import release
from pipelines.parallel import sequence
from pipelines.prompt_cache import PromptCache, lora_scope
from pipelines.prompt_cache import install as install_prompt_cache
from pipelines.redux_flux import check_redux_request, is_redux_source, redux_names
from pipelines.stepping.preview import LinearPreview
from pipelines.stepping.state import LastMerge, RowSplit
from pipelines.tasks.base import Task
from pipelines.timing import CudaTimer, device_timer


def _check_call_takes_defaults(pipe: DiffusionPipeline, config: PipelineConfig) -> None:
    """Fail at start where the config sets a default the pipeline's call has no argument for:
    every request would otherwise fail, or silently run without it."""
    takes = inspect.signature(pipe.__call__).parameters
    if config.timesteps and "timesteps" not in takes:
        raise ValueError(f"timesteps: {type(pipe).__name__}'s call takes no fixed timesteps")
    if config.default_negative_prompt is not None and "negative_prompt" not in takes:
        raise ValueError(f"default_negative_prompt: {type(pipe).__name__} takes no negative prompt")


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

    def __init__(self, pipe: DiffusionPipeline, config: PipelineConfig) -> None:
        self.config = config
        self.family = self.family_class(pipe, config, self.use)
        default_size = config.default_size or self.task.default_size or self.family.default_size()
        self.default_width, self.default_height = default_size
        # Fixed timesteps (a distilled model's) are the steps every request takes, whatever an
        # embedded model's default.
        self.steps = len(config.timesteps) or config.default_steps or self.family.default_steps
        guidance = config.default_guidance_scale
        self.guidance_scale = self.family.default_guidance_scale if guidance is None else guidance
        true_cfg = config.default_true_cfg_scale
        self.true_cfg_scale = self.family.default_true_cfg_scale if true_cfg is None else true_cfg
        _check_call_takes_defaults(pipe, config)
        # Read here, where the weights are: `spec()`'s weightless copy (the front process's,
        # with process workers) answers admission with it.
        denoiser = self.family.cached_denoiser()
        self.whole_batch_hooks = denoiser is not None and hasattr(denoiser, "enable_cache")
        # Why First-Block Cache cannot run in a lane that splits tokens (read from the denoisers'
        # context-parallel plans, here where the weights are), or None.
        self.first_block_split_refusal = sequence.first_block_refusal(self.family.cached_denoisers())
        self._check_served_cache(type(pipe).__name__)
        self.loras: LoraAdapters | None = LoraAdapters(pipe, config)
        self.loras.check()
        self.family.controlnets = self._load_controlnets(pipe, type(pipe).__name__)
        # Each ControlNet's number of modes (0: not a union one), kept for admission, which
        # runs on `spec()`'s copy without the weights.
        self.control_modes = {} if self.family.controlnets is None else self.family.controlnets.modes()
        self.fuses_union = self.family.controlnets is not None and self.family.controlnets.fuses_union
        self.family.ip_adapters = self._load_ip_adapters(pipe, type(pipe).__name__)
        # What reduces each reference image before it queues, by IP-Adapter name: the CLIP
        # feature extractor, or a Redux prior's SigLIP processor (no weights: admission's copy keeps it).
        self.reference_extractors = self._reference_extractors(pipe)
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
        # In a lane of several devices: its share of each step (`pipelines.parallel`, set
        # once the lane's group is joined).
        self.row_split: RowSplit | None = None
        # Step mode's last merged conditioning, reused while its group steps on unchanged.
        self.last_merge = LastMerge()

    def _load_controlnets(self, pipe: DiffusionPipeline, class_name: str) -> ControlNetSet | None:
        """The configured ControlNets, or None; fail at start where the model cannot take them."""
        if not self.config.controlnets:
            return None
        if not self.family.takes_controlnet() or not self.supports_step_batch:
            raise ValueError(
                f"--controlnet: {class_name} takes no ControlNet here (Stable Diffusion 1.x/2.x, "
                "SDXL and FLUX.1 text-to-image, image-to-image and inpainting, and Qwen-Image "
                "text-to-image do, batched step by step)"
            )
        return self.family.load_controlnets(self.config.controlnets)

    def _load_ip_adapters(self, pipe: DiffusionPipeline, class_name: str) -> IPAdapters | None:
        """The configured IP-Adapters, or None (a FLUX Redux prior goes to the family's
        `redux`); fail at start where the model cannot take them."""
        sources = self.config.ip_adapters
        if not sources:
            return None
        if not self.family.takes_ip_adapter() or not self.supports_step_batch:
            raise ValueError(
                f"--ip-adapter: {class_name} takes no IP-Adapter here (Stable Diffusion 1.x/2.x, "
                "SDXL and FLUX.1 text-to-image, image-to-image and inpainting do, batched step by step)"
            )
        redux = [(name, source) for name, source in sources if is_redux_source(source)]
        adapters = tuple((name, source) for name, source in sources if not is_redux_source(source))
        if redux and not self.family.takes_redux():
            raise ValueError(
                f"--ip-adapter {redux[0][0]}={redux[0][1]}: a FLUX Redux prior (not a weights file); "
                f"{class_name} takes none here (FLUX.1 text-to-image, image-to-image and inpainting do)"
            )
        if len(redux) > 1 or (redux and adapters):
            raise ValueError(
                "--ip-adapter: one FLUX Redux prior per model, without IP-Adapters beside it (not yet)"
            )
        if redux:
            self.family.redux = self.family.load_redux(*redux[0])
            return None
        return self.family.load_ip_adapters(adapters)

    def _reference_extractors(self, pipe: DiffusionPipeline) -> dict[str, Any]:
        redux = self.family.redux
        return {
            name: redux.feature_extractor
            if redux is not None and name == redux.name
            else pipe.feature_extractor
            for name, _ in self.config.ip_adapters
        }

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
        lane = self.config.lane
        if mode == "first-block" and lane is not None and lane.shape.sequence > 1:
            refusal = self.first_block_split_refusal
            if refusal is not None:
                return f"{refusal}; --sequence-parallel splits its tokens"
        request_level = self.config.denoiser.warmup_batching == "request" or not self.supports_step_batch
        if not request_level:
            if mode == "first-block" and self._ip_attention_in_cached_blocks():
                return (
                    "its IP-Adapters add image attention per row inside the blocks that the "
                    "first-block cache runs on fewer rows (not yet)"
                )
            if mode in self.family.step_cache_modes():
                return None
            return "its denoiser does not take this cache per request in a shared step"
        if not self.whole_batch_hooks:
            return "diffusers' cache hooks do not fit its denoiser with request-level batching"
        return None

    def _ip_attention_in_cached_blocks(self) -> bool:
        """Whether IP-Adapter processors sit in the denoiser's blocks (FLUX.1's), which a
        first-block cache cuts to the rows that compute while the processors index all rows."""
        sources = self.config.ip_adapters
        return self.family.ip_attention_in_blocks and any(not is_redux_source(s) for _, s in sources)

    def _check_served_cache(self, class_name: str) -> None:
        """Fail at start, not at each request, where the configured cache cannot run here."""
        served_cache = effective(self.config.cache)
        refusal = None if served_cache is None else self.cache_refusal(served_cache.mode)
        if refusal is not None:
            raise ValueError(
                f"cache: {class_name} cannot be served with cache mode {self.config.cache.mode!r}: {refusal}"
            )

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
        state.pop("taylor_seer", None)  # it holds the denoiser (`denoiser_of`), as row_cache its hooks
        state.pop("row_split", None)  # it holds the lane's process group
        state.pop("last_merge", None)  # tensors of requests stepping here
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.linear_preview = LinearPreview()
        self.row_cache = None
        self.taylor_seer = None
        self.row_split = None
        self.last_merge = LastMerge()

    def cache_blocks_skipped(self) -> int:
        """Denoiser blocks skipped by step mode's First-Block Cache and TaylorSeer so far, over
        all requests (the step stages report them for `/metrics`)."""
        first_block = 0 if self.row_cache is None else self.row_cache.blocks_skipped
        return first_block + (0 if self.taylor_seer is None else self.taylor_seer.blocks_skipped)

    def decode_out_of_memory(self) -> int:
        """Decodes that ran out of memory and were halved so far (`engine.worker.forward` reports
        them for `/metrics`)."""
        return out_of_memory_count(getattr(self.pipe, "vae", None))

    def prompt_cache_counts(self) -> dict[str, float] | None:
        """The prompt cache's cumulative counts (`engine.worker.forward` reports them for
        `/metrics`), or None without one."""
        return self.prompt_cache.counts() if self.prompt_cache is not None else None

    def _lora_scope(self) -> Any:
        return lora_scope(self.loras.active if self.loras is not None else None)

    def compiled_graphs(self) -> int:
        """Graphs torch.compile has compiled so far for a compiled denoiser (`engine.worker.forward`
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
        shell.safety_checker = None  # the worker checks; the engine's process has no use for it
        shell.loras = None
        shell.family.controlnets = None  # weights; admission reads the names from the config
        shell.family.ip_adapters = None  # as ControlNets; the image processors stay
        shell.family.redux = None
        return shell

    def close(self) -> None:
        release(self.pipe)

    def stage_timer(self) -> CudaTimer | None:
        """CUDA events on a GPU (the runner times each step on the device, not its kernel
        launches); None on the CPU: the host's clock."""
        return device_timer(self.device)

    # Admission: `pipelines.admission` ------------------------------------------------------

    def resolve(self, request: GenerationRequest) -> SamplingParams:
        return admission.resolve(self, request)

    def validate(self, params: SamplingParams) -> None:
        admission.validate(self, params)

    def max_steps(self) -> int:
        return admission.max_steps(self.pipe)

    def default_params(self) -> SamplingParams:
        return admission.default_params(self)

    def validate_controls(self, controls: tuple[ControlRef, ...]) -> None:
        served = [name for name, _ in self.config.controlnets]
        refuse_unserved([control.name for control in controls], served, "ControlNet", "controlnet")
        check_modes(controls, self.control_modes, fused=self.fuses_union)

    def validate_ip_adapters(self, refs: tuple[IPAdapterRef, ...], params: SamplingParams) -> None:
        served = [name for name, _ in self.config.ip_adapters]
        refuse_unserved([ref.name for ref in refs], served, "IP-Adapter", "ip_adapter")
        check_redux_request(refs, params, redux_names(self.config.ip_adapters))

    def reduce_inputs(self, request: GenerationRequest) -> GenerationRequest:
        reduced = self.task.reduce_inputs(self.family, request)
        if reduced.controls:
            reduced = reduced_controls(reduced)
        if reduced.ip_adapters and self.config.ip_adapters:  # otherwise admission refuses them
            reduced = reduced_references(reduced, self.reference_extractors)
        return reduced

    def batch_key(self, request: GenerationRequest) -> BatchKey:
        return admission.batch_key(self, request)

    def step_key(self, request: GenerationRequest) -> BatchKey:
        return admission.step_key(self, request)

    def step_cost(self, request: GenerationRequest) -> int:
        return admission.step_cost(self, request, super().step_cost(request))

    def step_grid(self, request: GenerationRequest) -> tuple[int, ...]:
        return admission.step_grid(self, request)

    def step_packs(self, request: GenerationRequest) -> bool:
        return admission.step_packs(self, request)

    # Request level: `pipelines.request_level` ----------------------------------------------

    def forward(self, batch: RequestBatch) -> list[RequestOutput]:
        if any(request.controls for request in batch.requests):
            return self._stepped_to_end(batch)
        return request_level.forward(self, batch)

    def _stepped_to_end(self, batch: RequestBatch) -> list[RequestOutput]:
        """A request-level batch that carries control images: run by the family's own stages,
        every request from its first step to its last together, then decoded. diffusers' call
        would need the family's ControlNet pipeline, one scale and window per call, and one
        control image per prompt; the stages take each request's own, as in step mode. Progress
        and the stop once nobody wants the batch as diffusers' step callback gives them."""
        states = self.prepare(list(batch.requests))
        total = max(state.total_steps for state in states)
        while running := [state for state in states if not state.is_done]:
            self.step(running)
            if self.interrupt is not None and self.interrupt.is_set():
                raise ForwardInterrupted
            if self.progress_callback is not None:
                self.progress_callback(batch.request_ids, max(s.steps_done for s in states), total)
        return self.finish(states)

    def use_lora(self, params: SamplingParams) -> None:
        """Run the next forward with the request's LoRA adapter (part of every key), or none."""
        if self.loras is not None:
            self.loras.activate(params.lora)

    # Step level: `pipelines.step_level` ------------------------------------------------------

    def prepare(self, requests: list[GenerationRequest]) -> list[Any]:
        return step_level.prepare(self, requests)

    def step(self, states: list[Any]) -> None:
        step_level.step(self, states)

    def finish(self, states: list[Any]) -> list[RequestOutput]:
        return step_level.finish(self, states)

    def preview(self, states: list[Any]) -> list[tuple[Any, ...]]:
        return step_level.preview(self, states)
