"""How many bytes of weights a loaded pipeline holds: what a served model costs to keep
resident (`engine.models.residency`), counted once per tensor storage (tied weights, components
shared between a pipeline and its img2img twin)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


def weight_bytes(pipeline: Any) -> int:
    """Bytes of the parameters and buffers of every torch module of `pipeline.pipe` (the
    diffusers pipeline of an adapter); 0 for a pipeline without one (test pipelines)."""
    import torch

    pipe = getattr(pipeline, "pipe", None)
    components = getattr(pipe, "components", None)
    if not isinstance(components, dict):
        return 0
    seen: set[tuple[str, int]] = set()
    total = 0
    for component in components.values():
        if not isinstance(component, torch.nn.Module):
            continue
        for weight in (*component.parameters(), *component.buffers()):
            for tensor in plain_tensors(weight):
                storage = tensor.untyped_storage()
                key = (str(tensor.device), storage.data_ptr())
                if key in seen or tensor.device.type == "meta":
                    continue
                seen.add(key)
                total += storage.nbytes()
    return total


def plain_tensors(tensor: Any) -> Iterator[Any]:
    """The tensors that hold `tensor`'s bytes: itself, or for a wrapper subclass (torchao's
    quantized weights: int8 data, scales, zero points) its inner tensors. A wrapper's own
    storage is a stand-in of the logical dtype's size, without a data pointer."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if not is_traceable_wrapper_subclass(tensor):
        yield tensor
        return
    names, _ = tensor.__tensor_flatten__()
    for name in names:
        inner = getattr(tensor, name)
        if inner is not None:
            yield from plain_tensors(inner)
