"""OpenAI wire schemas. Parsing happens here, at the edge; the engine gets dataclasses.

The request models are strict: a JSON body's number is a number and its boolean a
boolean (`"priority": "1"` or `"timeout": true` is a 400 naming the field, not quietly
converted). A form's fields are all strings, so the form routes (edits, multipart
videos) validate with `strict=False`, which converts them.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from engine.request import (
    BATCHING_HINT,
    MAX_CONTROL_SCALE,
    MAX_CONTROLNETS,
    MAX_IP_ADAPTER_SCALE,
    MAX_IP_ADAPTERS,
    MAX_PRIORITY,
    MAX_SEED,
    MIN_PRIORITY,
    TAYLOR_SEER_LIMITS,
    CacheChoice,
    Quality,
    SamplingParams,
)

BATCHING_DOCS = "See 'How batching works' in docs/batching.md (linked from the README)."

_SIZE = re.compile(r"^(\d{1,5})x(\d{1,5})$")

OutputFormat = Literal["png", "jpeg", "webp"]

# As OpenAI's image models accept; a prompt is echoed in video objects, so it is bounded.
MAX_PROMPT_CHARS = 32_000
# A LoRA's scale: 1 as trained, 0 off, negative pushes away from what it learnt.
MAX_LORA_SCALE = 2.0
# Model and adapter names: a name not served is echoed in its 404, so it is bounded.
MAX_NAME_CHARS = 256


class OnePrompt(BaseModel):
    """One prompt, never a list: each call is one request (a list is refused, saying so)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    prompt: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS)

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value: Any) -> Any:
        if isinstance(value, list):
            raise ValueError(f"prompt must be one string, not a list. {BATCHING_HINT} {BATCHING_DOCS}")
        return value


class LoraChoice(BaseModel):
    """A LoRA adapter served here (`/v1/models` lists them) and how strongly to apply it."""

    model_config = ConfigDict(extra="forbid", strict=True)

    name: str = Field(max_length=MAX_NAME_CHARS)
    scale: float = Field(1.0, ge=-MAX_LORA_SCALE, le=MAX_LORA_SCALE)


class ControlSettings(BaseModel):
    """A ControlNet served here (`/v1/models` lists them), its scale, and the share of the
    steps it steers, from `start` to `end` (diffusers' `control_guidance_start`/`_end`), and a
    union ControlNet's `mode` (checked against the ControlNet at admission): a `controlnet`
    entry but its image (an edit form's may be a file part, `server.control_form`)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    name: str = Field(max_length=MAX_NAME_CHARS)
    scale: float = Field(1.0, ge=0, le=MAX_CONTROL_SCALE, allow_inf_nan=False)
    start: float = Field(0.0, ge=0, le=1, allow_inf_nan=False)
    end: float = Field(1.0, ge=0, le=1, allow_inf_nan=False)
    mode: int | None = Field(None, ge=0)


class ControlField(ControlSettings):
    """A `controlnet` entry of a JSON body: its settings and its control image, a data URL or
    bare base64 (resized to the request's size)."""

    image: str


class IPAdapterSettings(BaseModel):
    """An IP-Adapter served here (`/v1/models` lists them) and the scale of its attention
    (diffusers' `set_ip_adapter_scale`): an `ip_adapter` entry but its reference image (an edit
    form's may be a file part, `server.control_form`)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    name: str = Field(max_length=MAX_NAME_CHARS)
    scale: float = Field(1.0, ge=0, le=MAX_IP_ADAPTER_SCALE, allow_inf_nan=False)


class IPAdapterField(IPAdapterSettings):
    """An `ip_adapter` entry of a JSON body: its settings and its reference image, a data URL
    or bare base64."""

    image: str


class CacheField(BaseModel):
    """Cache acceleration for this request (`engine.request.CacheChoice`)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    mode: Literal["none", "first-block", "taylorseer"]
    # first-block's (the server's --cache-threshold when not given); taylorseer's interval,
    # warmup and order (diffusers' defaults when not given). A setting of the other mode is
    # refused by `CacheChoice`.
    threshold: float | None = Field(None, ge=0, le=1, allow_inf_nan=False)
    interval: int | None = Field(None, ge=1, le=TAYLOR_SEER_LIMITS["interval"])
    warmup: int | None = Field(None, ge=0, le=TAYLOR_SEER_LIMITS["warmup"])
    order: int | None = Field(None, ge=0, le=TAYLOR_SEER_LIMITS["order"])

    def choice(self) -> CacheChoice:
        taylor_seer = {
            name: value for name in TAYLOR_SEER_LIMITS if (value := getattr(self, name)) is not None
        }
        # No threshold: the server's --cache-threshold, filled in at admission.
        return CacheChoice(self.mode, self.threshold, **taylor_seer)


class GenerationFields(OnePrompt):
    """What every generation endpoint takes: one prompt, a size, and the diffusion extensions."""

    model: str | None = Field(None, max_length=MAX_NAME_CHARS)
    # A LoRA adapter over the base model: its name, or {"name", "scale"} (or model: NAME).
    lora: LoraChoice | None = None
    size: str = "auto"
    # Cache acceleration: {"mode": "first-block", "threshold": 0.1} (default: the server's).
    cache: CacheField | None = None

    @field_validator("cache", mode="before")
    @classmethod
    def _cache_from_form(cls, value: Any) -> Any:
        # A form field (edits, videos) is a string: the object as JSON.
        if isinstance(value, str):
            try:
                return json.loads(value)
            except (ValueError, RecursionError):
                raise ValueError(
                    'cache must be a JSON object such as {"mode": "first-block", "threshold": 0.1}'
                ) from None
        return value

    @field_validator("lora", mode="before")
    @classmethod
    def _lora_by_name(cls, value: Any) -> Any:
        # A form field (edits, videos) is a string: a name, or the object as JSON.
        if isinstance(value, str) and value.lstrip().startswith("{"):
            try:
                return json.loads(value)
            except (ValueError, RecursionError):  # RecursionError: JSON nested thousands deep
                raise ValueError(
                    'lora must be an adapter name or a JSON object such as {"name": "NAME", "scale": 0.8}'
                ) from None
        if isinstance(value, str):
            return {"name": value}
        if value is not None and not isinstance(value, dict | LoraChoice):
            raise ValueError('must be an adapter name or an object such as {"name": "NAME", "scale": 0.8}')
        return value

    # Diffusion extensions (the official client sends them through `extra_body`).
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    num_inference_steps: int | None = Field(None, ge=1)
    guidance_scale: float | None = Field(None, allow_inf_nan=False)
    negative_prompt: str | None = Field(None, max_length=MAX_PROMPT_CHARS)
    # Scheduling: lower runs first (as vLLM's); none = the API key's default, else 0.
    priority: int | None = Field(None, ge=MIN_PRIORITY, le=MAX_PRIORITY)
    # Seconds from arrival to this request's deadline, at most its default (the API key's SLO,
    # else the server's timeout): a caller may ask to be answered sooner, never later.
    timeout: float | None = Field(None, gt=0, allow_inf_nan=False)

    @field_validator("negative_prompt", mode="before")
    @classmethod
    def _one_negative_prompt(cls, value: Any) -> Any:
        if isinstance(value, list):
            raise ValueError(f"negative_prompt must be one string, not a list. {BATCHING_HINT}")
        return value

    @field_validator("size")
    @classmethod
    def _size_shape(cls, value: str) -> str:
        if value != "auto" and not _SIZE.match(value):
            raise ValueError(f"size must be 'auto' or WIDTHxHEIGHT such as '512x512', got {value!r}")
        return value

    def lora_param(self) -> str:
        """The field that chose the request's LoRA adapter: `lora` when given, else `model`."""
        return "lora" if self.lora is not None else "model"

    def width_height(self) -> tuple[int | None, int | None]:
        if self.size == "auto":
            return None, None
        width, height = self.size.split("x")
        return int(width), int(height)

    def sampling_params(self, **endpoint_fields: Any) -> SamplingParams:
        """The engine's parameters for this body; each endpoint adds its own fields."""
        width, height = self.width_height()
        return SamplingParams(
            width=width,
            height=height,
            num_inference_steps=self.num_inference_steps,
            guidance_scale=self.guidance_scale,
            negative_prompt=self.negative_prompt,
            seed=self.seed,
            cache=None if self.cache is None else self.cache.choice(),
            # The route filled in the API key's default (`server.state.caller_priority`).
            priority=0 if self.priority is None else self.priority,
            **endpoint_fields,
        )


class ImageGenerationRequest(GenerationFields):
    """`POST /v1/images/generations`: OpenAI's fields plus diffusion extensions.

    `quality` picks the step count when `num_inference_steps` is not given (low, medium,
    high: a quarter, half, all of the model's default; `hd`, `xhigh` and `max` are high,
    `standard` and `auto` the default). `moderation` sets the safety checker's threshold
    (`low`: lenient) where the server has one (`--safety-checker`), and is unchecked without.
    `style`, `complexity`, `user` and `safety_identifier` are accepted for compatibility and
    do not change the image.
    `frame_count`, `frame_duration_ms` (GIF output) and `svg` (SVG output) are refused by
    name: this server makes PNG, JPEG and WebP.
    """

    n: int = Field(1, ge=1, le=10)
    response_format: Literal["b64_json", "url"] = "b64_json"
    output_format: OutputFormat = "png"
    output_compression: int | None = Field(None, ge=0, le=100)
    stream: bool = False
    partial_images: int = Field(0, ge=0, le=3)
    quality: Literal["auto", "low", "medium", "high", "xhigh", "max", "standard", "hd"] | None = None
    style: Literal["vivid", "natural"] | None = None
    background: Literal["auto", "opaque", "transparent"] | None = None
    moderation: Literal["auto", "low"] | None = None
    complexity: Literal["low", "medium", "high"] | None = None
    # GIF and SVG output: typed loosely so that any value gets the message below.
    frame_count: Any = None
    frame_duration_ms: Any = None
    svg: Any = None
    user: str | None = None
    safety_identifier: str | None = None
    true_cfg_scale: float | None = Field(None, allow_inf_nan=False)
    # Only families that start from the input image take it (edits); refused elsewhere.
    strength: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    # ControlNets served beside the model, each with its control image (an edit's come as
    # form fields, `server.control_form`).
    controlnet: list[ControlField] | None = Field(None, min_length=1, max_length=MAX_CONTROLNETS)
    # IP-Adapters served beside the model, each with its reference image (an edit's come as
    # form fields, `server.control_form`).
    ip_adapter: list[IPAdapterField] | None = Field(None, min_length=1, max_length=MAX_IP_ADAPTERS)

    @field_validator("frame_count", "frame_duration_ms", "svg")
    @classmethod
    def _no_gif_or_svg(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None:
            output = "SVG" if info.field_name == "svg" else "GIF"
            raise ValueError(
                f"{info.field_name} is for {output} output, which this server does not make "
                "(output_format: png, jpeg or webp)"
            )
        return value

    def quality_tier(self) -> Quality | None:
        """The quality tier that decides the step count: None when the request names its
        steps, or asks for `auto`/`standard` (the model's default)."""
        if self.num_inference_steps is not None:
            return None
        return _QUALITY_TIERS.get(self.quality or "auto")


_QUALITY_TIERS: dict[str, Quality] = {
    "low": "low",
    "medium": "medium",
    "high": "high",
    "hd": "high",
    "xhigh": "high",
    "max": "high",
}


class ImageEditRequest(ImageGenerationRequest):
    """The form fields of `POST /v1/images/edits` besides the uploads (`image`, `mask`).

    `input_fidelity` is accepted for compatibility and does not change the image.
    """

    input_fidelity: Literal["high", "low"] | None = None


# What a variation is drawn with: image-to-image of the upload with no prompt, so nothing but
# the image steers it, redrawing the last 70% of the schedule. Less than diffusers' edit
# default (0.8) because no prompt pulls the redrawn part back to the subject: at 0.7 Stable
# Diffusion starts from the image at 0.29 of its amplitude under noise at 0.96 (0.19 at 0.8),
# so its composition and colours survive while shapes and textures are drawn anew.
VARIATION_PROMPT = ""
VARIATION_STRENGTH = 0.7
# A model served with an IP-Adapter draws a variation steered by the image's CLIP embedding
# through its first IP-Adapter at this scale (`server.routes.variations`): 1, the IP-Adapter
# authors' setting for variations without a prompt, where nothing else competes with the image.
VARIATION_IP_ADAPTER_SCALE = 1.0


class ImageVariationRequest(ImageGenerationRequest):
    """The form fields of `POST /v1/images/variations` besides the upload (`image`): those of
    generations but the prompt (a variation has none: `VARIATION_PROMPT`) and streaming
    (OpenAI's variations endpoint answers JSON only), with `strength` defaulting to
    `VARIATION_STRENGTH`."""

    prompt: str = VARIATION_PROMPT
    strength: float | None = Field(VARIATION_STRENGTH, gt=0, le=1, allow_inf_nan=False)

    @field_validator("prompt", mode="before")
    @classmethod
    def _no_prompt(cls, value: Any) -> Any:
        raise ValueError(
            "a variation takes no prompt: it redraws the image alone; to steer it with a prompt "
            "send both to /v1/images/edits"
        )

    @field_validator("stream")
    @classmethod
    def _no_stream(cls, value: bool) -> bool:
        if value:
            raise ValueError("variations are not streamed: leave stream out for the JSON answer")
        return value


class ImageObject(BaseModel):
    b64_json: str | None = None
    url: str | None = None
    revised_prompt: str | None = None
    seed: int


class ImagesResponse(BaseModel):
    created: int
    data: list[ImageObject]
    output_format: OutputFormat
    size: str
    # The quality tier that chose the step count (absent: the model's default steps).
    quality: Quality | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "diffbatch"
    # As vLLM: the base model of the served weights, and for a LoRA adapter its base.
    root: str | None = None
    parent: str | None = None
    # Extensions: which endpoints the model answers (image, edit, video; null until it has
    # loaded once) and whether it is loaded now (a server of several models loads on use),
    # with its residency state there: loaded, loading, parked (weights in host memory, back
    # on use without a load), unloaded or failed.
    endpoints: list[str] | None = None
    # "controlnet" for a ControlNet served beside `parent` (named in a request's `controlnet`),
    # "ip_adapter" for an IP-Adapter (named in a request's `ip_adapter`).
    kind: str | None = None
    # A union ControlNet's modes by number (a request's `controlnet[i].mode`): their names, for
    # those known by source (`server.control_modes`); null for other ControlNets and models.
    modes: list[str] | None = None
    loaded: bool | None = None
    state: str | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody
