"""The family contract: one network and how it runs, whatever the task.

A family instance is "this network, loaded for one use": it holds the diffusers pipeline,
the config, the device its inputs go to (read once), its size multiple and the lock every
VAE call takes. Its class says which tasks it serves (`uses`, one `TaskUse` line each), its
defaults, and how it guides and sizes images (`pipelines.families.policies`). Its step
hooks (encode, schedule, noise, denoise, merge, guide, decode) are what
`pipelines.adapter.DiffusersAdapter` and the tasks drive; its cache-acceleration hooks are
what `pipelines.cache` reads; its input-media primitives are what the tasks that bring
inputs compose their stages from. Tasks see a family only through
`pipelines.tasks.family.TaskFamily`, the part of this contract they call. Every hook is a
method of this one class, with its default here; a family overrides the ones it needs.

This base is also the generic family: request-level only (`steps()` is False), with
diffusers' usual `__call__` defaults, which is what serves a plain `DiffusersAdapter` (no family declared).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from diffusers import DiffusionPipeline
from torch import Tensor

from engine.request import GenerationRequest, SamplingParams
from pipelines.base import PipelineConfig
from pipelines.families.policies import CLASSIFIER_FREE, UNET, Guidance, Sizes
from pipelines.loading import load_diffusers
from pipelines.stepping.setup import flow_skipped_steps
from pipelines.stepping.state import Conditioning, DenoiseState, Encoded, classifier_free, concatenate
from pipelines.tasks.base import TEXT_TO_IMAGE, Task

if TYPE_CHECKING:
    from pipelines.controlnet import ControlNetSet
    from pipelines.ip_adapter import IPAdapters
    from pipelines.redux_flux import FluxRedux


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


class Family:
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
    # Whether its IP-Adapters' per-row attention runs inside the denoiser's transformer blocks
    # (FLUX.1's), which a first-block cache runs on fewer rows than the forward has.
    ip_attention_in_blocks: ClassVar[bool] = False
    # Rows of different sizes may step in one denoiser forward (`mixes_sizes_for`): the
    # family's `denoise` packs them end to end (`packs_sizes`) or pads them to one token grid
    # with an attention mask (`pads_sizes`), so no token attends to another row or to
    # padding, and positions each row's tokens by its own size.
    mixes_sizes: ClassVar[bool] = False
    # How it mixes sizes, or why it keeps one step group per size (the family table says it).
    mixes_sizes_why: ClassVar[str] = "its denoiser takes one latent shape per forward"
    # The tasks whose rows it mixes: each of them keeps a request's own latents, input
    # latents and mask at its own size in its state (`after_step` included), so only the
    # denoiser forward sees the padding.
    mixing_tasks: ClassVar[tuple[Task, ...]] = (TEXT_TO_IMAGE,)
    # Whether a request under First-Block Cache may step beside rows of other sizes: the
    # family's `denoise` names each row's own places on the grid to the cache
    # (`denoiser_call(places=...)`), so a request's decision and residuals read its own tokens
    # only, and every per-row input of its blocks is one the cache cuts to the rows that
    # compute (`pipelines.cache.block_args`). Only the class that declares it counts, as
    # `splits_cfg` (a subclass with its own forward says it again).
    caches_mixed_sizes: ClassVar[bool] = False
    # Whether its `denoise` packs rows of different sizes end to end, one attention document
    # each (`pipelines.stepping.packed_rows`), instead of padding them to one grid: for the
    # requests `packs_sizes_for` admits. Only the class that declares it counts.
    packs_sizes: ClassVar[bool] = False
    # Whether its `denoise` can pad rows of different sizes to one grid instead (every
    # family that mixes sizes but SD3, whose attention takes no mask): where it cannot, a
    # request it does not pack keeps one step group per size.
    pads_sizes: ClassVar[bool] = True
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
        # The ControlNets served beside the model (`--controlnet`), where it takes them; the
        # adapter sets them after loading.
        self.controlnets: ControlNetSet | None = None
        # The IP-Adapters served beside it (`--ip-adapter`), likewise, or its FLUX Redux prior.
        self.ip_adapters: IPAdapters | None = None
        self.redux: FluxRedux | None = None

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

    # Whether a lane of several devices may split its steps' guided rows between them
    # (`--cfg-parallel`, `pipelines.parallel.lane_split`): a family whose forward takes
    # `step_together`'s rows as they are, each state's negative rows apart from its
    # positive ones. Verified family by family (tests/pipelines/test_cfg_parallel.py), so
    # only the class that declares it counts: a subclass with its own forward says it again.
    # Where it also caches per row (First-Block Cache), its step is one denoiser forward: the
    # two shares sum each request's figures once per forward (`LaneSplit`).
    splits_cfg: ClassVar[bool] = False
    # Whether its ControlNets split with the guided rows (`--controlnet` in a CFG lane): each
    # branch's rows get residuals of their own, computed wherever the rows run. FLUX's
    # ControlNet steers the positive rows and reuses their residuals for the negative ones,
    # which the lane's other device runs, so it is not declared there. Verified family by
    # family as `splits_cfg` (tests/pipelines/test_cfg_parallel.py).
    splits_cfg_with_controlnet: ClassVar[bool] = False
    # Why it never has negative rows to split, where it has none (a guidance-distilled model).
    no_cfg: ClassVar[str | None] = None
    # Whether a lane may split its forwards' tokens between devices with its denoiser's
    # context-parallel plan (`--sequence-parallel`, `pipelines.parallel.sequence`): a family
    # whose denoiser call passes the plan's inputs as the plan expects them, and that says
    # how long they are (`sequence_lengths`). Verified family by family, as `splits_cfg`
    # (tests/pipelines/test_sequence_parallel.py): only the class that declares it counts.
    splits_tokens: ClassVar[bool] = False

    def sequence_lengths(self, params: SamplingParams) -> dict[str, int]:
        """The length of each sequence the denoiser's context-parallel plan cuts, by what it
        holds, for a request's rows (in a family that `splits_tokens`); a sequence the family
        pads to a multiple of the degree itself (Qwen-Image's text) is not among them."""
        raise NotImplementedError(f"{type(self).__name__} does not split its tokens between devices")

    def reference_tokens(self, request: GenerationRequest) -> int:
        """The image tokens a request's reference images add after its own, in the sequence
        the plan cuts with them (FLUX.2's and Qwen-Image-Edit's references); 0 without."""
        return 0

    def sequence_degree(self) -> int:
        """How many devices split each forward's tokens (`--sequence-parallel`); 1 alone."""
        lane = self.config.lane
        return 1 if lane is None else lane.shape.sequence

    # Step level -----------------------------------------------------------------------------

    def steps(self) -> bool:
        """Whether these weights run in the family's stages (read live: a config can say
        no, and a test changes it after loading)."""
        return False

    def step_key_extras(self, params: SamplingParams) -> tuple[Any, ...]:
        return ()

    @classmethod
    def mixes_sizes_in(cls, task: Task) -> bool:
        """Whether the family steps rows of different sizes in one forward for `task` (the
        family table's column; a request's own settings may still keep it to its size)."""
        return cls.mixes_sizes and task in cls.mixing_tasks

    def mixes_sizes_for(self, task: Task, request: GenerationRequest) -> bool:
        """Whether a request of `task` may step beside rows of other sizes (its step key then
        leaves the size out): in a family that mixes them (`mixes_sizes`), for a task it
        mixes, unless the server says not to (`--mix-sizes off`); packed where the family
        packs the request (`packs_sizes_for`), else padded to one grid where the family pads
        (`pads_sizes`), through the native attention backend (the one that takes a mask),
        with a cache that reads only the request's own tokens
        (`caches_alone_beside_other_sizes`)."""
        if not (self.mixes_sizes_in(task) and self.config.mix_sizes):
            return False
        if self.packs_sizes_for(task, request):
            return True
        return (
            self.pads_sizes
            and self.config.denoiser.attention_backend == "native"
            and self.caches_alone_beside_other_sizes(request)
        )

    def packs_sizes_for(self, task: Task, request: GenerationRequest) -> bool:
        """Whether a request of `task` steps in packed forwards (its step key says so, so a
        forward packs all its rows or none): in a family whose `denoise` packs
        (`packs_sizes`), unless the server pads (`--mix-sizes pad`), through any attention
        backend (rows attend by size, without a mask), without hooks on the transformer's own `forward`
        (offload, `--compile`: a packed forward runs the transformer's parts, not it), and for
        a request whose forward is the plain transformer's: no cache (its hooks and decisions
        are per batch row), ControlNet or IP-Adapter (their residuals and attention are per
        batch row)."""
        cache = request.params.cache
        config = self.config
        return (
            bool(vars(type(self)).get("packs_sizes", False))
            and self.mixes_sizes_in(task)
            and config.mix_sizes
            and config.pack_sizes
            and config.denoiser.compile == "off"
            and config.memory.offload == "none"
            and (cache is None or not cache.on)
            and not request.controls
            and not request.ip_adapters
        )

    def packs_forward(self, states: list[Any], grids: list[tuple[int, ...]]) -> bool:
        """Whether a forward over `states` (their rows' token `grids`) runs packed: rows of
        more than one size, every request of them packing (`packs_sizes_for`; one that does
        not makes the forward pad them all, where the family pads)."""
        return len(set(grids)) > 1 and all(
            self.packs_sizes_for(self.use.task, state.request) for state in states
        )

    def caches_alone_beside_other_sizes(self, request: GenerationRequest) -> bool:
        """Whether a request's cache decides as alone beside rows of other sizes: without a
        cache; with TaylorSeer (a schedule, and a series of the request's own output, cut to
        its size); with First-Block Cache where the family names each row's own tokens to it
        (`caches_mixed_sizes`). Elsewhere First-Block Cache would judge a row by all its
        tokens, padding included, and its decision would depend on who shares the forward."""
        cache = request.params.cache
        if cache is None or not cache.on or cache.mode == "taylorseer":
            return True
        return bool(vars(type(self)).get("caches_mixed_sizes", False))

    def token_grid(self, request: GenerationRequest) -> tuple[int, ...]:
        """The (height, width) of a request's rows in tokens, in a family that mixes sizes."""
        raise NotImplementedError(f"{type(self).__name__} does not mix sizes in one forward")

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

    def takes_controlnet(self) -> bool:
        """Whether its step adds ControlNet residuals per row (`pipelines.controlnet`)."""
        return False

    def load_controlnets(self, sources: tuple[tuple[str, str], ...]) -> ControlNetSet:
        """The ControlNets `--controlnet` names, loaded beside the model (where it takes them)."""
        raise NotImplementedError(f"{type(self).__name__} takes no ControlNet")

    def control_images(
        self, request: GenerationRequest, generators: list[torch.Generator]
    ) -> tuple[Tensor, ...]:
        """The request's control images as its ControlNets read them (`ControlNetSet.images`);
        none without them. A task's prepare calls it before drawing the noise."""
        if not request.controls or self.controlnets is None:
            return ()
        with self.vae_lock:  # FLUX's encodes them; a decode may be running beside
            return self.controlnets.images(request, generators, self.device)

    def takes_ip_adapter(self) -> bool:
        """Whether its step adds IP-Adapter image attention per row (`pipelines.ip_adapter`)."""
        return False

    def load_ip_adapters(self, sources: tuple[tuple[str, str], ...]) -> IPAdapters:
        """The IP-Adapters `--ip-adapter` names, loaded into the model (where it takes them)."""
        raise NotImplementedError(f"{type(self).__name__} takes no IP-Adapter")

    def takes_redux(self) -> bool:
        """Whether a FLUX Redux prior can give its requests their text (`pipelines.redux_flux`)."""
        return False

    def load_redux(self, name: str, source: str) -> FluxRedux:
        """The Redux prior `--ip-adapter NAME=SOURCE` names, beside the model (where it takes one)."""
        raise NotImplementedError(f"{type(self).__name__} takes no FLUX Redux")

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

    # Cache acceleration: read by `pipelines.cache` and the adapter's cache choice ------------

    def cached_denoiser(self) -> torch.nn.Module | None:
        """The transformer whose blocks First-Block Cache skips (`pipelines.cache`), or None
        where it does not apply: diffusers' hooks must work on it (request mode), and the
        family calls it once per step with every row of the group, in `step_together`'s
        order. Step mode takes more (`first_block_steps`, `cached_denoisers`)."""
        return None

    def cached_denoisers(self) -> tuple[torch.nn.Module, ...]:
        """Every denoiser a step may call, for step mode's First-Block Cache: the one of
        `cached_denoiser`, or more where a family steps with several (Wan 2.2's experts)."""
        denoiser = self.cached_denoiser()
        return () if denoiser is None else (denoiser,)

    def step_cache_modes(self) -> frozenset[str]:
        """The cache modes a request may choose in step mode, each request deciding for itself
        inside a shared step (`pipelines.cache`)."""
        modes = {"first-block"} if self.first_block_steps() else set()
        if self.taylor_seer_steps():
            modes.add("taylorseer")
        return frozenset(modes)

    def first_block_steps(self) -> bool:
        """Whether First-Block Cache runs per request in this family's shared steps: one
        denoiser whose blocks it hooks, called once per step with every row
        (`cached_denoiser`). Families whose steps differ override this, and say which
        forward each call is (`pipelines.cache.calls.denoiser_call`) and which denoisers
        they call (`cached_denoisers`)."""
        return self.cached_denoiser() is not None

    def taylor_seer_steps(self) -> bool:
        """Whether TaylorSeer runs per request in this family's shared steps: it predicts a
        request's guided output (what its scheduler steps with) and keeps its rows out of the
        step's forwards, so it needs nothing of the denoiser: every family that steps takes
        it (asked in step mode only). A family whose steps cannot leave rows out says no."""
        return True

    def step_denoiser(self, state: DenoiseState) -> torch.nn.Module:
        """The module that computes `state`'s rows at its step: its blocks are what TaylorSeer's
        predicted steps skip, and a request whose module changes (Wan 2.2's experts) starts a
        new series. The transformer, else the UNet."""
        transformer: torch.nn.Module | None = getattr(self.pipe, "transformer", None)
        return transformer if transformer is not None else self.pipe.unet

    # Input media: the primitives the tasks that bring inputs compose their stages from -------
    # (`pipelines.tasks.family.TaskFamily`). Only the families that declare those tasks write
    # them; these defaults refuse, naming the family, except noising and skipped steps, which
    # follow flow matching or Stable Diffusion's pipelines.

    def encode_image(
        self,
        request: GenerationRequest,
        pixels: Tensor,
        generators: list[torch.Generator],
        dtype: torch.dtype,
    ) -> Tensor:
        """The input's VAE latents (unpacked), sampled with the request's generators; the
        caller holds `vae_lock`."""
        raise NotImplementedError(f"{type(self).__name__} takes no input image")

    def noise_shape(self, request: GenerationRequest) -> tuple[int, ...]:
        """The shape of an inpainting request's noise (unpacked)."""
        raise NotImplementedError(f"{type(self).__name__} does not inpaint")

    def noised(
        self, scheduler: Any, image: Tensor, noise: Tensor, first: int, *, full: bool = False
    ) -> Tensor:
        """`image` noised to the request's timestep `first` (unpacked): flow matching mixes
        the two (`scale_noise`); otherwise `add_noise`, or with `full` the noise alone at the
        scheduler's initial sigma (strength 1, as the inpainting pipelines start)."""
        at = scheduler.timesteps[first : first + 1].repeat(image.shape[0])
        if self.flow_matching:
            mixed: Tensor = scheduler.scale_noise(image, at, noise)
            return mixed
        if full:
            scaled: Tensor = noise * scheduler.init_noise_sigma
            return scaled
        added: Tensor = scheduler.add_noise(image, noise, at)
        return added

    def pack(self, latents: Tensor, request: GenerationRequest) -> Tensor:
        """Latents as the denoiser takes them (2x2 patches as tokens for FLUX, Qwen-Image)."""
        return latents

    def skipped_steps(self, steps: int, strength: float) -> int:
        """How many of its steps an image-to-image request skips, as the family's diffusers
        `get_timesteps` counts them: the flow-matching pipelines round the skipped steps
        down, Stable Diffusion's the redrawn steps."""
        if self.flow_matching:
            return flow_skipped_steps(steps, strength)
        return max(steps - min(int(steps * strength), steps), 0)

    def reads_mask(self) -> bool:
        """Whether the denoiser takes the mask and the masked image as inputs."""
        return False

    def reference_latents(
        self, request: GenerationRequest, generators: list[torch.Generator], prompts: Encoded
    ) -> Tensor:
        """A reference edit's start latents, its input image's latents put into both
        conditionings."""
        raise NotImplementedError(f"{type(self).__name__} takes no reference image")

    def reference_sizes(self, request: GenerationRequest) -> tuple[tuple[int, int], ...]:
        """(width, height) of each of the request's references as the pipeline sizes them."""
        raise NotImplementedError(f"{type(self).__name__} takes no reference images")

    def check_references(self, request: GenerationRequest) -> None:
        """Raise `InvalidRequestError` (naming `image`) for references the pipeline refuses."""

    def reference_call_kwargs(self) -> dict[str, Any]:
        """Other arguments of a request-level call with references."""
        return {}

    def add_references(self, request: GenerationRequest, prompts: Encoded) -> None:
        """Put the request's reference tokens (and their position ids) into both
        conditionings, one row per image."""
        raise NotImplementedError(f"{type(self).__name__} takes no reference images")

    def reference_output_size(self, request: GenerationRequest) -> tuple[int, int]:
        """A multi-reference edit's (width, height) when it sets none, from its images."""
        raise NotImplementedError(f"{type(self).__name__} takes no reference images")

    def reduce_references(self, request: GenerationRequest) -> GenerationRequest:
        """The request with its references reduced as the pipeline first reduces them, so a
        large upload does not wait in the queue at full size; the request itself where the
        pipeline uses them as sent."""
        return request

    def image_to_video_latents(
        self, request: GenerationRequest, generators: list[torch.Generator], prompts: Encoded
    ) -> Tensor:
        """An image-to-video request's start latents, its image's conditioning put into both
        conditionings."""
        raise NotImplementedError(f"{type(self).__name__} makes no video from an image")

    def control_latents(
        self, request: GenerationRequest, generators: list[torch.Generator], prompts: Encoded
    ) -> Tensor:
        """A controlled video's start latents (its references' frames included), its control
        latents put into both conditionings."""
        raise NotImplementedError(f"{type(self).__name__} takes no control video")

    def mask_latents(
        self,
        request: GenerationRequest,
        condition: Tensor,
        pixels: Tensor,
        generators: list[torch.Generator],
        dtype: torch.dtype,
    ) -> tuple[Tensor, Tensor | None]:
        """The mask at latent size, packed as the latents (1 = repaint), and the masked
        image's latents where the denoiser reads them."""
        raise NotImplementedError(f"{type(self).__name__} does not inpaint")


GENERIC_TEXT_TO_IMAGE = TaskUse(TEXT_TO_IMAGE, "")
