"""The plain request and output types every layer shares.

A leaf module: it imports nothing else of the project and no torch, so the server can
build requests and pipelines can read them without either depending on the other.
"""

from __future__ import annotations

import math
import secrets
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, Literal

# One hashable tuple of every parameter that must be equal inside one pipeline forward.
# Pipeline adapters build it; the scheduler only compares keys for equality.
BatchKey = tuple[Any, ...]

OutputType = Literal["np", "latent"]
# A share of the model's default steps, for requests that name no step count
# (`pipelines.work.steps_for_quality`): OpenAI's `quality`.
Quality = Literal["low", "medium", "high"]
# OpenAI's `moderation`: the safety checker's default threshold, or a lenient one.
Moderation = Literal["auto", "low"]

MAX_SEED = 2**63 - 1
# Scheduling priority (lower runs first, as vLLM's): wide enough for any tiering, small
# enough that an aged rank (`engine.sched.priority`) stays exact.
MIN_PRIORITY = -1000
MAX_PRIORITY = 1000
# As OpenAI's image models: at most 3 previews per request.
MAX_PARTIAL_IMAGES = 3
# Cache acceleration (`CacheChoice`): what a request may ask for.
CacheMode = Literal["none", "first-block", "taylorseer"]
CACHE_MODES: tuple[CacheMode, ...] = ("none", "first-block", "taylorseer")
# TaylorSeer's settings (`CacheChoice`): their defaults (diffusers' `TaylorSeerCacheConfig`'s)
# and the largest accepted.
TAYLOR_SEER_DEFAULTS = {"interval": 5, "warmup": 3, "order": 1}
TAYLOR_SEER_LIMITS = {"interval": 100, "warmup": 1000, "order": 4}

BATCHING_HINT = (
    "Send one request per prompt: independent requests that arrive together are "
    "batched automatically into one forward, so nothing is lost by splitting them."
)


class InvalidRequestError(ValueError):
    """The request cannot be served as given; the message says what to change.

    `param` names the offending field, so the HTTP layer can report it.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param

    def __reduce__(self) -> tuple[object, ...]:  # keeps `param` when pickled
        return (type(self), (str(self), self.param))


class UnsupportedFieldError(InvalidRequestError):
    """A field this model has no use for (`strength` on a model that does no image-to-image):
    refused by name rather than ignored. Its own class so that an endpoint that sets the
    field itself (variations set `strength`) can say what the model lacks instead."""


class ForwardInterrupted(Exception):  # noqa: N818 - it is not an error: the work was abandoned
    """Raised inside a pipeline forward, at a step boundary, when every request of its batch
    has been aborted (or the server is stopping): the rest of the work is for nobody."""


@dataclass(frozen=True, slots=True)
class LoraRef:
    """A LoRA adapter to apply for one request, by name or path, with its scale."""

    name: str
    scale: float = 1.0


# ControlNets one request may use at once, and a control image's scale bounds.
MAX_CONTROLNETS = 4
MAX_CONTROL_SCALE = 2.0


@dataclass(frozen=True, slots=True)
class ControlRef:
    """A ControlNet served beside the model (`--controlnet NAME=SOURCE`), applied to one
    request: its control image (uint8 HxWx3), its scale, the share of the request's steps
    it steers, from `start` to `end` (diffusers' `control_guidance_start`/`_end`), and for a
    union ControlNet (one model, several kinds of control image) the kind of this image,
    `mode` (diffusers' `control_mode`; None for a ControlNet of one kind)."""

    name: str
    image: Any
    scale: float = 1.0
    start: float = 0.0
    end: float = 1.0
    mode: int | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.end <= 1:
            raise InvalidRequestError(
                "controlnet start and end must satisfy 0 <= start < end <= 1, "
                f"got {self.start} and {self.end}",
                "controlnet",
            )

    def keep(self, step: int, total_steps: int) -> float:
        """Its scale at `step` of `total_steps`: 0 outside its window, as diffusers'
        `controlnet_keep`."""
        outside = step / total_steps < self.start or (step + 1) / total_steps > self.end
        return self.scale * (1.0 - float(outside))


# IP-Adapters one request may use at once, and a reference image's scale bound.
MAX_IP_ADAPTERS = 4
MAX_IP_ADAPTER_SCALE = 2.0


@dataclass(frozen=True, slots=True)
class IPAdapterRef:
    """An IP-Adapter served beside the model (`--ip-adapter NAME=SOURCE`), applied to one
    request: its reference image (uint8 HxWx3) and the scale of the image's attention
    (diffusers' `set_ip_adapter_scale`; 0 leaves the image out)."""

    name: str
    image: Any
    scale: float = 1.0


@dataclass(frozen=True, slots=True)
class CacheChoice:
    """Cache acceleration for one request: with `first-block`, a denoiser step whose first
    block's output changed by less than `threshold` (relative mean difference to the last
    step that ran every block) reuses the rest of the blocks' effect from that step instead
    of running them. `none`, or a threshold of 0, runs every block. A threshold of None is
    the served model's (`--cache-threshold`), filled in at admission (`Pipeline.resolve`).

    With `taylorseer`, the first `warmup` steps run the denoiser, and after them one step in
    every `interval` (diffusers' schedule); the steps between take the denoiser's output
    predicted from a Taylor series of `order` over the request's own computed steps. An
    interval of 1 runs every step."""

    mode: CacheMode = "none"
    threshold: float | None = None
    interval: int = TAYLOR_SEER_DEFAULTS["interval"]
    warmup: int = TAYLOR_SEER_DEFAULTS["warmup"]
    order: int = TAYLOR_SEER_DEFAULTS["order"]

    def __post_init__(self) -> None:
        if self.mode not in CACHE_MODES:
            modes = ", ".join(CACHE_MODES)
            raise InvalidRequestError(f"cache.mode must be one of {modes}, got {self.mode!r}", "cache.mode")
        value = self.threshold
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1
        ):
            raise InvalidRequestError(
                f"cache.threshold must be a number from 0 to 1, got {value!r}", "cache.threshold"
            )
        if self.mode == "taylorseer" and value not in (None, 0):
            raise InvalidRequestError(
                "cache.threshold applies to mode first-block; taylorseer takes interval, warmup and order",
                "cache.threshold",
            )
        for name, most in TAYLOR_SEER_LIMITS.items():
            value = getattr(self, name)
            least = 1 if name == "interval" else 0
            if type(value) is not int or not least <= value <= most:
                raise InvalidRequestError(
                    f"cache.{name} must be a whole number from {least} to {most}, got {value!r}",
                    f"cache.{name}",
                )
            if self.mode != "taylorseer" and value != TAYLOR_SEER_DEFAULTS[name]:
                raise InvalidRequestError(f"cache.{name} applies to mode taylorseer", f"cache.{name}")

    @property
    def on(self) -> bool:
        if self.mode == "taylorseer":
            return self.interval > 1
        return self.mode != "none" and (self.threshold is None or self.threshold > 0)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to generate: everything about a request except its prompt.

    `None` means "the served model's default" for size, steps and guidance; the engine
    fills those in at admission (`Pipeline.resolve`) so a forward never sees `None`.
    A `None` seed is drawn at random once at admission and reported back.
    """

    width: int | None = None
    height: int | None = None
    num_frames: int | None = None
    fps: int | None = None
    # For video: the asked length; the model turns it into a frame count it can make.
    duration_s: float | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    true_cfg_scale: float | None = None
    # Two-expert models (Wan 2.2 A14B): the low-noise expert's guidance scale.
    guidance_scale_2: float | None = None
    # Controlled video (Wan VACE): how strongly the control latents steer (diffusers' default 1).
    conditioning_scale: float | None = None
    negative_prompt: str | None = None
    seed: int | None = None
    n: int = 1
    output_type: OutputType = "np"
    lora: LoraRef | None = None
    # Image edits: how far to move away from the input image (families that take it).
    strength: float | None = None
    # Previews of the image while it denoises, at evenly spaced steps (step-level batching).
    partial_images: int = 0
    # Decides the step count when `num_inference_steps` is None.
    quality: Quality | None = None
    # Cache acceleration; None: the server's `--cache` (filled in at admission).
    cache: CacheChoice | None = None
    # Scheduling only (`engine.sched.priority`): lower runs first; never changes the image.
    priority: int = 0
    # How strictly the safety checker judges its images, where the server has one
    # (`engine.worker.moderation`): "auto" its default threshold, "low" a lenient one.
    moderation: Moderation = "auto"

    def __post_init__(self) -> None:
        _check_positive("n", self.n)
        if type(self.priority) is not int or not MIN_PRIORITY <= self.priority <= MAX_PRIORITY:
            raise InvalidRequestError(
                f"priority must be an integer from {MIN_PRIORITY} to {MAX_PRIORITY}, got {self.priority!r}",
                "priority",
            )
        for name in ("width", "height", "num_frames", "fps", "num_inference_steps"):
            value = getattr(self, name)
            if value is not None:
                _check_positive(name, value)
        finite = (
            "guidance_scale",
            "true_cfg_scale",
            "guidance_scale_2",
            "conditioning_scale",
            "duration_s",
            "strength",
        )
        for name in finite:
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int | float) or not math.isfinite(value)):
                raise InvalidRequestError(f"{name} must be a finite number, got {value!r}", name)
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed <= MAX_SEED
        ):
            raise InvalidRequestError(
                f"seed must be an integer in [0, {MAX_SEED}], got {self.seed!r}", "seed"
            )
        partial = self.partial_images
        if type(partial) is not int or not 0 <= partial <= MAX_PARTIAL_IMAGES:
            raise InvalidRequestError(
                f"partial_images must be an integer from 0 to {MAX_PARTIAL_IMAGES}, got {partial!r}",
                "partial_images",
            )
        if self.negative_prompt is not None and not isinstance(self.negative_prompt, str):
            raise InvalidRequestError(
                "negative_prompt must be one string; " + BATCHING_HINT, "negative_prompt"
            )
        if self.moderation not in ("auto", "low"):
            raise InvalidRequestError(
                f"moderation must be 'auto' or 'low', got {self.moderation!r}", "moderation"
            )
        if self.quality not in (None, "low", "medium", "high"):
            raise InvalidRequestError(
                f"quality must be 'low', 'medium' or 'high', got {self.quality!r}", "quality"
            )
        if self.output_type not in ("np", "latent"):
            raise InvalidRequestError(
                f"output_type must be 'np' or 'latent', got {self.output_type!r}", "output_type"
            )

    def image_seeds(self) -> list[int]:
        """One seed per output image: seed, seed+1, ... so image 0 equals the n=1 image."""
        if self.seed is None:
            raise RuntimeError("seed is drawn at admission; params were not resolved")
        return [(self.seed + i) % (MAX_SEED + 1) for i in range(self.n)]


def _check_positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidRequestError(f"{name} must be a positive integer, got {value!r}", name)


def draw_seed() -> int:
    return secrets.randbelow(MAX_SEED + 1)


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One independent request: exactly one prompt and its sampling parameters.

    `arrival_time` and `deadline` are `time.monotonic()` readings. `input_images` (uint8
    HxWx3 arrays) and `mask` are the inputs of image edits and image-to-video. A controlled
    video (Wan VACE) brings `control_video` (uint8 FxHxWx3), its `mask` (HxW for every frame,
    or FxHxW; 255 = redraw) and its reference images as `input_images`.
    """

    request_id: str
    prompt: str
    params: SamplingParams = field(default_factory=SamplingParams)
    arrival_time: float = field(default_factory=time.monotonic)
    deadline: float | None = None
    input_images: tuple[Any, ...] = ()
    mask: Any | None = None
    control_video: Any | None = None
    # The ControlNets it uses, each with its control image, in the order their residuals add.
    controls: tuple[ControlRef, ...] = ()
    # The IP-Adapters it uses, each with its reference image and scale.
    ip_adapters: tuple[IPAdapterRef, ...] = ()
    # A digest of the input images' pixels, computed off the event loop at admission
    # (`AsyncEngine.prepare_inputs`), for batch keys that must tell images apart.
    input_digest: str | None = None
    # Who sent it, for fair share between senders (`engine.sched.fair_share`): the API key's
    # log-safe name (`key#2`), "" without keys; and that key's weight. Scheduling only:
    # not in `SamplingParams`, so never in an image or a BatchKey.
    tenant: str = ""
    tenant_weight: float = 1.0
    # The W3C `traceparent` of the span its engine work is traced under (`server.tracing`:
    # its HTTP request's), carried to wherever the engine runs it (a Ray Serve replica);
    # None: untraced. Opaque to the engine, and never in a key.
    traceparent: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.prompt, str):
            kind = (
                "a list of prompts" if isinstance(self.prompt, list | tuple) else type(self.prompt).__name__
            )
            raise InvalidRequestError(f"prompt must be one string, got {kind}. {BATCHING_HINT}", "prompt")
        if not self.request_id or not isinstance(self.request_id, str):
            raise InvalidRequestError("request_id must be a non-empty string", "request_id")
        weight = self.tenant_weight
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not 0 < weight < math.inf:
            raise InvalidRequestError(
                f"tenant_weight must be a finite number > 0, got {weight!r}", "tenant_weight"
            )

    @classmethod
    def create(
        cls,
        prompt: str,
        params: SamplingParams | None = None,
        *,
        timeout_s: float | None = None,
        input_images: tuple[Any, ...] = (),
        mask: Any | None = None,
        request_id: str | None = None,
        control_video: Any | None = None,
        controls: tuple[ControlRef, ...] = (),
        ip_adapters: tuple[IPAdapterRef, ...] = (),
        tenant: str = "",
        tenant_weight: float = 1.0,
        traceparent: str | None = None,
    ) -> GenerationRequest:
        """A request arriving now, optionally due within `timeout_s`, with `request_id` or a
        fresh one, sent by `tenant` (with its fair-share weight), traced under `traceparent`."""
        now = time.monotonic()
        return cls(
            request_id=request_id or f"gen-{uuid.uuid4().hex}",
            prompt=prompt,
            params=params or SamplingParams(),
            arrival_time=now,
            deadline=None if timeout_s is None else now + timeout_s,
            input_images=input_images,
            mask=mask,
            control_video=control_video,
            controls=controls,
            ip_adapters=ip_adapters,
            tenant=tenant,
            tenant_weight=tenant_weight,
            traceparent=traceparent,
        )

    def with_params(self, params: SamplingParams) -> GenerationRequest:
        return replace(self, params=params)

    @property
    def has_inputs(self) -> bool:
        """Whether the request carries inputs besides its prompt: images (edits, references,
        image-to-video), a mask, a control video, control images or reference images."""
        return (
            bool(self.input_images)
            or self.mask is not None
            or self.control_video is not None
            or bool(self.controls)
            or bool(self.ip_adapters)
        )

    @property
    def input_bytes(self) -> int:
        """Memory held by the input images, mask, control video, control and reference images
        while the request is in the engine."""
        arrays = (
            *self.input_images,
            self.mask,
            self.control_video,
            *(c.image for c in self.controls),
            *(r.image for r in self.ip_adapters),
        )
        return sum(int(getattr(array, "nbytes", 0)) for array in arrays)


@dataclass(frozen=True, slots=True)
class RequestBatch:
    """Requests that share one `BatchKey` and run as one pipeline forward, in arrival order."""

    key: BatchKey
    requests: tuple[GenerationRequest, ...]

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def num_images(self) -> int:
        return sum(r.params.n for r in self.requests)

    @property
    def request_ids(self) -> list[str]:
        return [r.request_id for r in self.requests]


def preview_steps(total_steps: int, partial_images: int) -> tuple[int, ...]:
    """After which steps (1-based counts of steps done) to preview: evenly spaced, never after
    the last step (the final image follows it). Fewer when steps are fewer than asked previews,
    as OpenAI allows ("the final image may come before all partial images")."""
    steps = {round(total_steps * (i + 1) / (partial_images + 1)) for i in range(partial_images)}
    return tuple(sorted(s for s in steps if 0 < s < total_steps))


@dataclass(frozen=True, slots=True)
class PartialImage:
    """A preview of a request's images while it denoises: `index` counts from 0 per request;
    `images` holds one uint8 HxWx3 array per output image (n)."""

    request_id: str
    index: int
    images: tuple[Any, ...]
    steps_done: int
    total_steps: int


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """What one request produced.

    `images` holds `n` arrays: uint8 HxWx3 for images (FxHxWx3 for video) with
    `output_type="np"`, float32 latents with `output_type="latent"`. `seeds[i]` re-creates
    `images[i]` alone with n=1.
    """

    request_id: str
    images: tuple[Any, ...]
    seeds: tuple[int, ...]
    extras: dict[str, Any] = field(default_factory=dict)


def steps_to_run(params: SamplingParams) -> int:
    """The denoising steps a request runs: its `num_inference_steps`, or for image-to-image
    the part its `strength` redraws (`int(steps x strength)`, as Stable Diffusion's
    `get_timesteps` rounds; a family that rounds otherwise is off by a step), at least one."""
    steps = params.num_inference_steps or 1
    if params.strength is None:
        return steps
    return max(1, min(int(steps * params.strength), steps))
