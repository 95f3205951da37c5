"""A model's own settings: which model, how a request's defaults and limits are filled in,
its scheduler and fixed timesteps, the LoRA adapters requests may choose, and the arguments
of its family's diffusers call. Each is a flag and a YAML key (`ServeSettings` inherits
these groups), and one of several models may set each for itself."""

from __future__ import annotations

import itertools
import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from pipelines.family_options import FamilyOptions
from pipelines.trained.shipped import DEFAULT_MODEL
from server.settings.section import MODEL_SECTION, Section

_SIZE = re.compile(r"^(\d+)x(\d+)$")
_ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


class ModelSettings(Section):
    help_section = MODEL_SECTION
    each_model = True

    model: str = Field(
        DEFAULT_MODEL,
        description="a shipped trained model (shapes, shapes-dit), a built-in tiny-* model, "
        "a local diffusers directory, or a hub id",
    )
    served_model_name: str | None = Field(
        None, description="the model id clients send and /v1/models lists (default: MODEL)"
    )
    preview_decoder: Literal["vae", "linear"] = Field(
        "linear",
        description="how partial_images previews are decoded in step mode: linear (a latent-to-RGB "
        "map fitted on the server's own final images: next to free, one colour per latent pixel; "
        "the VAE until 4 images are done, and always for models with a safety checker) or vae "
        "(the model's VAE: true previews, each as costly as a final decode)",
    )
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        "auto", description="weights dtype; auto = bfloat16 on GPU, float32 on CPU"
    )
    pipeline_class: str | None = Field(
        None, description="module:Class of a custom pipelines.base.Pipeline to serve the model"
    )
    default_size: str | None = Field(None, description="WxH used for size=auto (default: the model's)")
    default_steps: int | None = Field(
        None, ge=1, description="num_inference_steps when a request sets none (default: the family's)"
    )
    default_guidance_scale: float | None = Field(
        None,
        allow_inf_nan=False,
        description="guidance_scale when a request sets none (default: the family's)",
    )
    default_guidance_scale_2: float | None = Field(
        None,
        allow_inf_nan=False,
        description="two-expert video models (Wan 2.2 A14B): the low-noise expert's guidance_scale_2 "
        "when a request sets none (default: the request's guidance_scale, as diffusers)",
    )
    default_true_cfg_scale: float | None = Field(
        None,
        allow_inf_nan=False,
        description="true_cfg_scale when a request sets none: the true CFG of FLUX, Qwen-Image and "
        "Kontext, which runs only with a negative prompt (default: the family's, 1 = off)",
    )
    default_negative_prompt: str | None = Field(
        None,
        max_length=4000,
        description="negative_prompt when a request sends none, e.g. ' ' to switch on true CFG by "
        "default (refused at start by a model that takes no negative prompt) (default: none)",
    )
    size_multiple: int | None = Field(
        None, ge=1, description="width and height must be multiples of this (default: the family's)"
    )
    scheduler: str | None = Field(
        None,
        description="a diffusers scheduler class to replace the model's, built from the model's "
        "scheduler config (LCMScheduler for DMD2-distilled SDXL)",
    )
    timesteps: list[int] = Field(
        default_factory=list,
        description="fixed timesteps every request runs, highest first (a distilled model's: DMD2's "
        "999 749 499 249); each request takes that many steps",
        json_schema_extra={"metavar": "T"},
    )
    max_pixels: int = Field(2048 * 2048, ge=1, description="largest width x height accepted")
    max_request_work: int | None = Field(
        None,
        ge=1,
        description="most work one request may ask for, in pixel-steps: n x frames x width x height "
        "x steps (default: 16 times the model's default request); more is refused with 400",
    )
    lora_modules: dict[str, str] = Field(
        default_factory=dict,
        description="LoRA adapters requests may use, NAME=SOURCE each (SOURCE: a .safetensors file or "
        "a directory holding one, a hub id, or tiny-lora-N with a tiny model; default: none); each is "
        "listed in /v1/models and chosen with model: NAME",
    )
    max_loras: int = Field(
        4, ge=1, description="LoRA adapters loaded in the model at once (the least recently used is unloaded)"
    )
    controlnet: dict[str, str] = Field(
        default_factory=dict,
        description="ControlNets loaded beside the model, NAME=SOURCE each, repeatable (SOURCE: a "
        "diffusers ControlNet directory, a hub id, or tiny-sd-controlnet with tiny-sd, "
        "tiny-sdxl-controlnet and the union tiny-sdxl-controlnet-union with tiny-sdxl, "
        "tiny-flux-controlnet and the union tiny-flux-controlnet-union with tiny-flux, "
        "tiny-qwen-image-controlnet with tiny-qwen-image; default: none); each is listed in "
        "/v1/models (a union one with its modes' names) and named in a request's controlnet "
        "field (Stable Diffusion 1.x/2.x, SDXL and FLUX.1 text-to-image, image-to-image and "
        "inpainting, Qwen-Image text-to-image)",
    )

    ip_adapter: dict[str, str] = Field(
        default_factory=dict,
        description="IP-Adapters loaded beside the model, NAME=SOURCE each, repeatable (SOURCE: a "
        "weights file, local or owner/repo/folder/file.safetensors on the hub with its CLIP image "
        "encoder in image_encoder/ beside it (FLUX.1: XLabs' layout, its encoder "
        "openai/clip-vit-large-patch14 unless image_encoder/ lies beside a local file), or "
        "tiny-sd-ip-adapter with tiny-sd, tiny-sdxl-ip-adapter with tiny-sdxl, "
        "tiny-flux-ip-adapter with tiny-flux; on FLUX.1 a FluxPriorReduxPipeline (owner/repo, a "
        "pipeline directory, or tiny-flux-redux) serves FLUX Redux; default: none); each is listed "
        "in /v1/models and "
        "named in a request's ip_adapter field (Stable Diffusion 1.x/2.x, SDXL and FLUX.1 "
        "text-to-image, image-to-image and inpainting, step-level batching)",
    )

    @field_validator("lora_modules", "controlnet", "ip_adapter", mode="before")
    @classmethod
    def _parse_lora_modules(cls, value: Any) -> Any:
        """NAME=SOURCE pairs from a flag (a list), a variable (comma-separated) or YAML (a
        mapping); names are model ids clients send."""
        if isinstance(value, str):
            value = [part for part in re.split(r"[,\s]+", value) if part]
        if isinstance(value, list | tuple):
            pairs = [str(item).partition("=") for item in value]
            if bad := [name for name, sep, source in pairs if not sep or not source.strip()]:
                raise ValueError(f"write each adapter as NAME=SOURCE, got {bad[0]!r}")
            names = [name.strip() for name, _, _ in pairs]
            if len(set(names)) < len(names):
                raise ValueError("each adapter name may be given once")
            value = {name.strip(): source.strip() for name, _, source in pairs}
        if isinstance(value, dict):
            for name in value:
                if not isinstance(name, str) or not _ADAPTER_NAME.fullmatch(name):
                    raise ValueError(f"adapter name {name!r}: use letters, digits, '.', '_' and '-'")
        return value

    @field_validator("timesteps", mode="before")
    @classmethod
    def _split_timesteps(cls, value: Any) -> Any:
        if isinstance(value, str):  # DIFFBATCH_TIMESTEPS=999,749,499,249
            value = [value]
        if isinstance(value, list | tuple):  # --timesteps 999 749 or --timesteps 999,749
            return [part for item in value for part in re.split(r"[,\s]+", str(item)) if part]
        return value

    @field_validator("timesteps")
    @classmethod
    def _check_timesteps(cls, value: list[int]) -> list[int]:
        # Schedulers run timesteps from noisy to clean; diffusers refuses any other order.
        if any(t < 0 for t in value) or any(a <= b for a, b in itertools.pairwise(value)):
            raise ValueError(f"must be non-negative and strictly decreasing, got {value}")
        return value

    @model_validator(mode="after")
    def _steps_of_fixed_timesteps(self) -> ModelSettings:
        if self.timesteps and self.default_steps not in (None, len(self.timesteps)):
            raise ValueError(
                f"default_steps ({self.default_steps}) differs from the {len(self.timesteps)} fixed timesteps"
            )
        return self

    @field_validator("default_size")
    @classmethod
    def _check_size(cls, value: str | None) -> str | None:
        if value is not None and not _SIZE.match(value):
            raise ValueError(f"must look like 512x512, got {value!r}")
        return value

    def default_size_pair(self) -> tuple[int, int] | None:
        """`default_size` as (width, height); None for the model's own."""
        if not self.default_size:
            return None
        width, height = self.default_size.split("x")
        return int(width), int(height)


class FamilySettings(Section):
    """Arguments of one family's diffusers call that a served model may set for every
    request, each left at the pipeline's own default when unset (`pipelines.family_options`)."""

    help_section = MODEL_SECTION
    each_model = True

    cfg_truncation: float | None = Field(
        None,
        ge=0,
        allow_inf_nan=False,
        description="Z-Image: classifier-free guidance is off once a step's normalised time "
        "(1 - t/1000) passes this; 1 keeps it on to the end (default: the pipeline's, 1.0)",
    )
    cfg_normalization: float | None = Field(
        None,
        ge=0,
        allow_inf_nan=False,
        description="Z-Image: cap each guided prediction's norm at this many times the "
        "conditional prediction's; 0 for no cap (default: the pipeline's, none)",
    )
    reference_resolution: int | None = Field(
        None,
        ge=32,
        description="Qwen-Image 2.1: its call's output_resolution, the side of the square "
        "area reference images are resized to and an edit's default size (default: the "
        "pipeline's, 1024)",
    )

    def family_options(self) -> FamilyOptions:
        return FamilyOptions(
            cfg_truncation=self.cfg_truncation,
            cfg_normalization=self.cfg_normalization,
            reference_resolution=self.reference_resolution,
        )
