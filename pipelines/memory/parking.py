"""Moving an idle model's weights to host memory and back (`engine.models.residency`: the least
recently used idle model is parked on the host rather than dropped, when a host budget
allows), with diffusers' own `DiffusionPipeline.to`.

Only plain weights move. A pipeline with offload hooks (model, sequential or group offload:
accelerate's and diffusers' hooks move components or blocks on each call and keep their
own idea of where each lives; `.to()` under them is refused or undone on the next call) or
with quantized weights (bitsandbytes refuses `.to()`, torchao and GGUF tensor subclasses
and layerwise float8 casting hooks do not all round-trip) is dropped instead: `park_blocker`
says why."""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)


def _modules(pipeline: Any) -> list[Any]:
    import torch

    components = getattr(getattr(pipeline, "pipe", None), "components", None)
    if not isinstance(components, dict):
        return []
    return [c for c in components.values() if isinstance(c, torch.nn.Module)]


def park_blocker(pipeline: Any) -> str | None:
    """Why `pipeline`'s weights cannot move to the host and back, or None."""
    pipe = getattr(pipeline, "pipe", None)
    if getattr(pipe, "_all_hooks", None):  # enable_model_cpu_offload
        return "it offloads its components (model offload hooks)"
    for module in _modules(pipeline):
        if getattr(module, "is_quantized", False) or getattr(module, "hf_quantizer", None) is not None:
            return "its weights are quantized"
        for sub in module.modules():
            # accelerate's hooks (sequential offload), diffusers' (group offload, layerwise casting)
            if (
                getattr(sub, "_hf_hook", None) is not None
                or getattr(sub, "_diffusers_hook", None) is not None
            ):
                return "hooks move or cast its weights on each call (offload or layerwise casting)"
    return None


def weights_device(pipeline: Any) -> str | None:
    """Where the pipeline's weights are (its first parameter's device), None without weights."""
    for module in _modules(pipeline):
        for parameter in module.parameters():
            return str(parameter.device)
    return None


def move_weights(pipeline: Any, device: str) -> None:
    """Every component of `pipeline.pipe` to `device`, finished when this returns: a
    transfer to or from a GPU is asynchronous, and the memory budget counts on it being
    done (and on the device's cached blocks being given back after a move to the host)."""
    import torch

    pipe = getattr(pipeline, "pipe", None)
    if pipe is None:
        return  # a test pipeline without weights
    before = weights_device(pipeline)
    # Cached prompt embeddings live where the text encoder ran: a parked model must not keep
    # them on the device, outside every budget. Encoding them again is cheap beside a load.
    prompt_cache = getattr(pipeline, "prompt_cache", None)
    if prompt_cache is not None:
        prompt_cache.clear()
    pipe.to(device)
    for where in (before, device):
        if where is not None and where.startswith("cuda"):
            torch.cuda.synchronize(where)
    if before is not None and before.startswith("cuda") and not device.startswith("cuda"):
        torch.cuda.empty_cache()  # the freed blocks back to the device, for the next model
