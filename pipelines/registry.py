"""Which adapter serves a model: keyed by the diffusers class in `model_index.json`.

Every family in `FAMILIES` says which diffusers classes it serves (its `uses`); the adapter
for one is composed from the family and the use's task (`composed`), once, and named
`pipelines.registry:<Family><Task suffix>` (`StableDiffusionInpaint`, `WanImageToVideo`, …),
which is the `--pipeline-class` path of a use no model index names. Adding a family: its file under
`pipelines/families/`, its tiny model, and a line in `FAMILIES`.
"""

from __future__ import annotations

import logging
import types
from dataclasses import replace
from typing import Any

from pipelines.adapter import DiffusersAdapter

# Before anything is composed: the old names are the classes composed for their pairs.
from pipelines.base import Pipeline, PipelineConfig
from pipelines.families.base import Family, TaskUse
from pipelines.families.chroma import Chroma
from pipelines.families.flux import Flux
from pipelines.families.flux2 import Flux2, Flux2Klein
from pipelines.families.flux_fill import FluxFill
from pipelines.families.flux_kontext import FluxKontext
from pipelines.families.hunyuan_video15 import HunyuanVideo15
from pipelines.families.ltx import LTX
from pipelines.families.ltx2 import LTX2
from pipelines.families.ovis_image import OvisImage
from pipelines.families.qwen_image import QwenImage
from pipelines.families.qwen_image_21 import QwenImage21
from pipelines.families.sd3 import StableDiffusion3
from pipelines.families.sdxl import StableDiffusionXL
from pipelines.families.stable_diffusion import StableDiffusion
from pipelines.families.wan import Wan
from pipelines.families.wan_vace import WanVACE
from pipelines.families.z_image import ZImage
from pipelines.generic import GenericAdapter
from pipelines.loading import diffusers_class_name, resolve_model_path
from pipelines.pipeline_class import import_class
from pipelines.tiny import TINY_MODELS
from pipelines.trained.shipped import SHIPPED_MODELS

logger = logging.getLogger(__name__)

# Every family served, each serving the diffusers classes of its `uses`.
FAMILIES: tuple[type[Family], ...] = (
    StableDiffusion,
    StableDiffusionXL,
    StableDiffusion3,
    Flux,
    QwenImage,
    QwenImage21,
    Wan,
    LTX,
    LTX2,
    HunyuanVideo15,
    ZImage,
    Chroma,
    OvisImage,
    Flux2,
    Flux2Klein,
    FluxKontext,
    FluxFill,
    WanVACE,
)
USES: dict[str, tuple[type[Family], TaskUse]] = {
    use.diffusers_class: (f, use) for f in FAMILIES for use in f.uses
}


# Adapters composed so far, by (family, diffusers class).
_COMPOSED: dict[tuple[type[Family], str], type[DiffusersAdapter]] = {}


def composed(family: type[Family], serves: str) -> type[DiffusersAdapter]:
    """The adapter of `family` for its use `serves`: made here, once, and kept in this module
    so that it pickles. A user's own subclass declared for the same pair is never handed out."""
    known = _COMPOSED.get((family, serves))
    if known is not None:
        return known
    name = _adapter_name(family, family.use_for(serves))
    cls = types.new_class(name, (DiffusersAdapter,), {"family": family, "serves": serves})
    cls.__module__ = __name__
    globals()[name] = cls
    _COMPOSED[family, serves] = cls
    return cls


def _adapter_name(family: type[Family], use: TaskUse) -> str:
    return use.name or f"{family.__name__}{use.task.suffix}"


def __getattr__(name: str) -> type[DiffusersAdapter]:
    """A composed adapter by its name, composed on first use, so a config can pick a use
    that no model index names: `pipeline_class: pipelines.registry:ZImageImageToImage`
    serves text-to-image weights through the family's img2img pipeline."""
    for family, use in USES.values():
        if _adapter_name(family, use) == name:
            return composed(family, use.diffusers_class)
    raise AttributeError(f"module {__name__} has no attribute {name}")


def adapter_for(class_name: str) -> type[Pipeline]:
    """The family adapter serving diffusers class `class_name`; ValueError if no family does."""
    try:
        family, _ = USES[class_name]
    except KeyError:
        known = ", ".join(sorted(USES))
        raise ValueError(
            f"no adapter serves {class_name}; supported: {known}. A custom adapter can be "
            "given as pipeline_class='module:Class' (a pipelines.base.Pipeline subclass)"
        ) from None
    return composed(family, class_name)


def adapter_for_model(class_name: str) -> type[Pipeline]:
    """The family adapter if one serves `class_name` (a family always wins), else the generic
    request-level adapter for any other diffusers pipeline class; ValueError for a class
    diffusers does not have (its message names it, and what to do)."""
    if class_name in USES:
        return adapter_for(class_name)
    import diffusers

    if getattr(diffusers, class_name, None) is None:
        raise ValueError(
            f"no adapter serves {class_name}: diffusers {diffusers.__version__} has no class of that "
            "name. A custom adapter can be given as pipeline_class='module:Class' (a "
            "pipelines.base.Pipeline subclass)"
        )
    # Diffusers' placeholder for a class whose packages are missing too: the generic adapter
    # refuses it at load, naming them.
    return GenericAdapter


def import_pipeline_class(spec: str) -> type[Pipeline]:
    """Import `module:Class` and check that it is a `Pipeline` subclass (`PipelineClassError`
    saying why not)."""
    return import_class(spec)


def with_embedded_defaults(config: PipelineConfig) -> PipelineConfig:
    """An embedded model (tiny or shipped trained) brings its own serving defaults, unless
    the config sets them."""
    embedded = TINY_MODELS.get(config.model) or SHIPPED_MODELS.get(config.model)
    if embedded is None:
        return config
    guidance = config.default_guidance_scale
    return replace(
        config,
        default_size=config.default_size or embedded.default_size,
        default_steps=config.default_steps or embedded.default_steps,
        default_guidance_scale=embedded.default_guidance_scale if guidance is None else guidance,
        default_true_cfg_scale=_first(config.default_true_cfg_scale, embedded, "default_true_cfg_scale"),
        default_negative_prompt=_first(config.default_negative_prompt, embedded, "default_negative_prompt"),
    )


def _first(configured: Any, embedded: object, name: str) -> Any:
    """The config's value, else the embedded model's (tiny models have fewer defaults)."""
    return getattr(embedded, name, None) if configured is None else configured


def load_pipeline(config: PipelineConfig) -> Pipeline:
    config = with_embedded_defaults(config)
    if config.pipeline_class:
        cls = import_pipeline_class(config.pipeline_class)
    else:
        class_name = diffusers_class_name(resolve_model_path(config.model))
        cls = adapter_for_model(class_name)
        if cls is GenericAdapter:
            logger.info(
                "loading %s (%s) with the generic adapter on %s", config.model, class_name, config.device
            )
            return GenericAdapter.load(config, class_name)
    logger.info("loading %s with %s on %s", config.model, cls.__qualname__, config.device)
    return cls.load(config)


# Every adapter composed at import: a process that unpickles one (the server reading a
# worker's `spec()` under `--executor process`) finds it here by name, whichever process
# composed it first.
for _family, _use in USES.values():
    composed(_family, _use.diffusers_class)
