"""Loading a diffusers pipeline onto a device: model path, its model index's class, dtype and
threads."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from diffusers import DiffusionPipeline
from diffusers.utils import logging as diffusers_logging
from transformers.utils import logging as transformers_logging

from pipelines.base import PipelineConfig
from pipelines.denoiser.loading import check_denoiser, prepare_denoiser
from pipelines.memory.loading import check_memory, fit, pretrained_kwargs
from pipelines.schedule import apply_schedule
from pipelines.tiny import is_tiny_model, tiny_model_dir
from pipelines.trained.shipped import is_shipped_model, shipped_model_dir

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def torch_dtype(config: PipelineConfig) -> torch.dtype:
    if config.dtype == "auto":
        # Half precision is what GPUs are fast at; CPUs are fastest and exact in float32.
        return torch.float32 if config.device == "cpu" else torch.bfloat16
    try:
        return _DTYPES[config.dtype]
    except KeyError:
        raise ValueError(f"dtype must be auto, {', '.join(_DTYPES)}; got {config.dtype!r}") from None


def resolve_model_path(model: str) -> str:
    """A local directory for embedded tiny models and shipped trained ones (`shapes`,
    `shapes-dit`); local paths and hub ids unchanged."""
    if is_tiny_model(model):
        return str(tiny_model_dir(model))
    if is_shipped_model(model):
        return str(shipped_model_dir(model))
    return model


def diffusers_class_name(model_path: str) -> str:
    """The `_class_name` of a local diffusers directory or hub id's `model_index.json`."""
    index = Path(model_path) / "model_index.json"
    if index.is_file():
        config = json.loads(index.read_text())
    elif Path(model_path).exists():
        raise ValueError(f"{model_path} has no model_index.json: it is not a diffusers pipeline directory")
    else:
        from diffusers import DiffusionPipeline  # a hub id: fetch only its model_index.json

        config = DiffusionPipeline.load_config(model_path)
    name = config.get("_class_name")
    if not isinstance(name, str):
        raise ValueError(f"model_index.json of {model_path} names no _class_name")
    return name


def load_diffusers(
    config: PipelineConfig,
    from_pretrained: Callable[..., DiffusionPipeline] | None = None,
    run_as: str | None = None,
) -> DiffusionPipeline:
    """Load onto the configured device, fitted to memory as `config.memory` says (dtypes per
    component, quantized weights, offload, bounded decodes: `pipelines.memory`);
    `from_pretrained(path, dtype, **kwargs)` replaces diffusers' own loader for families that
    need help (Qwen-Image-Edit without torchvision). `run_as`: the diffusers class to run the
    weights in instead of their model index's (img2img and inpainting over text-to-image
    weights), given the components as loaded and fitted in that class (`share_components`)."""
    # Before anything loads: a setting this host cannot run is refused, naming its flag.
    check_memory(config)
    check_denoiser(config)
    # Progress bars are noise in a server log; load and step timings go to our own logs.
    diffusers_logging.disable_progress_bar()
    transformers_logging.disable_progress_bar()
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    path, dtype = resolve_model_path(config.model), torch_dtype(config)
    kwargs = pretrained_kwargs(config, path, dtype)
    if from_pretrained is None:
        pipe = DiffusionPipeline.from_pretrained(path, **kwargs)
    else:
        pipe = from_pretrained(path, kwargs.pop("dtype"), **kwargs)
    if run_as is not None and type(pipe).__name__ != run_as:
        pipe = share_components(pipe, run_as)
    # Fitted last, on the pipeline that serves: offload hooks belong to the pipeline whose
    # calls free them (`maybe_free_model_hooks`), and LoRA loads through it.
    fit(pipe, config)
    prepare_denoiser(pipe, config)
    apply_schedule(pipe, config)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def share_components(pipe: DiffusionPipeline, class_name: str) -> DiffusionPipeline:
    """`pipe`'s components in the diffusers pipeline class `class_name`, as they are.

    diffusers' `from_pipe` does this and then ends with `.to(dtype)` (float32 when none is
    given): a bfloat16 model ran in float32, per-component dtypes were flattened, float8
    storage upcast, and torchao/GGUF models refuse the cast outright. This is its sharing
    without the cast: the components the class takes, and its optional config values
    (`requires_safety_checker`, `force_zeros_for_empty_prompt`, ...) from `pipe`'s config."""
    import diffusers

    cls = getattr(diffusers, class_name)
    expected, optional = cls._get_signature_keys(cls)
    kwargs: dict[str, Any] = {name: c for name, c in pipe.components.items() if name in expected}
    kwargs.update({name: pipe.config[name] for name in optional if name in pipe.config})
    shared: DiffusionPipeline = cls(**kwargs)
    if (source := pipe.config.get("_name_or_path")) is not None:
        shared.register_to_config(_name_or_path=source)
    return shared


@dataclass(frozen=True, slots=True)
class ComponentConfig:
    """A model component without its weights: its config and dtype."""

    config: Any
    dtype: torch.dtype


def weightless(pipe: DiffusionPipeline) -> DiffusionPipeline:
    """A shallow copy of `pipe` whose model components (`torch.nn.Module`s) are replaced by
    their configs: schedulers, processors, tokenizers and attributes stay. Small to
    pickle, and enough for an adapter's pure calls."""
    shell = copy.copy(pipe)
    # Its offload files are the pipeline's own to remove (`memory.loading.release`), and a
    # finalizer does not pickle.
    shell.__dict__.pop("_offload_files", None)
    for name, component in pipe.components.items():
        if isinstance(component, torch.nn.Module):
            # Around DiffusionPipeline.__setattr__, which would register a new component.
            dtype = next((p.dtype for p in component.parameters()), torch.float32)
            shell.__dict__[name] = ComponentConfig(getattr(component, "config", None), dtype)
    return shell
