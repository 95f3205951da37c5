"""Components in dtypes of their own (`--component-dtype vae=float32`): each such component
takes its inputs in its own dtype.

diffusers loads them with `from_pretrained(dtype={"default": ..., "vae": ...})`, but its
pipelines (and our step stages, which follow them) make latents in the text encoder's or the
denoiser's dtype and hand them on as they are: Wan's casts to its VAE's dtype, Stable
Diffusion's does not. So the loader casts floating inputs at each overridden component's
entry points: a forward pre-hook on the module (every call of it, whoever makes it) and the
VAE's `encode` / `decode`, which diffusers calls without `forward`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch


def cast_inputs_of(pipe: Any, names: list[str]) -> None:
    """Make the named components cast floating tensor inputs to their own dtype."""
    for name in names:
        component = getattr(pipe, name, None)
        if not isinstance(component, torch.nn.Module):
            continue
        dtype = next((p.dtype for p in component.parameters() if p.is_floating_point()), None)
        if dtype is None:
            continue
        component.register_forward_pre_hook(_pre_hook(dtype), with_kwargs=True)
        for method in ("encode", "decode"):
            if callable(getattr(component, method, None)):
                setattr(component, method, _casting(getattr(component, method), dtype))


def _cast(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != dtype:
        return value.to(dtype)
    return value


def _pre_hook(dtype: torch.dtype) -> Callable[..., Any]:
    def hook(
        _module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return tuple(_cast(a, dtype) for a in args), {k: _cast(v, dtype) for k, v in kwargs.items()}

    return hook


def _casting(method: Callable[..., Any], dtype: torch.dtype) -> Callable[..., Any]:
    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        return method(*(_cast(a, dtype) for a in args), **{k: _cast(v, dtype) for k, v in kwargs.items()})

    return call
