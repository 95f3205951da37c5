"""Loading a diffusers pipeline onto a device: model path, dtype and threads."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from diffusers import DiffusionPipeline
from diffusers.utils import logging as diffusers_logging
from transformers.utils import logging as transformers_logging

from pipelines.base import PipelineConfig
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


def load_diffusers(
    config: PipelineConfig, from_pretrained: Callable[..., DiffusionPipeline] | None = None
) -> DiffusionPipeline:
    """Load onto the configured device, fitted to memory as `config.memory` says (dtypes per
    component, quantized weights, offload, bounded decodes: `pipelines.memory`);
    `from_pretrained(path, dtype, **kwargs)` replaces diffusers' own loader for families that
    need help (Qwen-Image-Edit without torchvision)."""
    # Before anything loads: a setting this host cannot run is refused, naming its flag.
    check_memory(config)
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
    fit(pipe, config)
    apply_schedule(pipe, config)
    pipe.set_progress_bar_config(disable=True)
    return pipe


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
    for name, component in pipe.components.items():
        if isinstance(component, torch.nn.Module):
            # Around DiffusionPipeline.__setattr__, which would register a new component.
            dtype = next((p.dtype for p in component.parameters()), torch.float32)
            shell.__dict__[name] = ComponentConfig(getattr(component, "config", None), dtype)
    return shell
