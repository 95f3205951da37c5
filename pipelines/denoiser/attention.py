"""`--attention-backend`: the denoiser's attention through diffusers' attention dispatcher
(`ModelMixin.set_attention_backend`), checked when the model loads: a backend the device
cannot run, whose package is missing or too old, or a model whose attention does not go
through the dispatcher is refused, naming the flag, before the first request."""

from __future__ import annotations

import logging
from typing import Any

import torch
from diffusers import ModelMixin
from diffusers.models.attention import AttentionModuleMixin
from diffusers.models.attention_dispatch import AttentionBackendName, _check_attention_backend_requirements
from diffusers.models.attention_processor import Attention

from pipelines.denoiser.compiling import denoisers_of
from pipelines.denoiser.options import DenoiserConfig, DenoiserSettingError, parse_attention_backend

logger = logging.getLogger(__name__)
FLAG = "--attention-backend"


def check_capability(config: DenoiserConfig, device: str) -> None:
    """Refuse a backend whose kernels need a newer GPU than `device` (FlashAttention 2 and
    SageAttention: Ampere, compute capability 8.0; FlashAttention 3: Hopper, 9.0)."""
    backend = parse_attention_backend(config.attention_backend)
    if not backend.cuda_only:
        return
    if not torch.cuda.is_available():
        raise DenoiserSettingError(FLAG, f"{config.attention_backend} needs CUDA; torch sees no CUDA device")
    capability = torch.cuda.get_device_capability(torch.device(device))
    if capability < backend.min_capability:
        need = ".".join(map(str, backend.min_capability))
        have = ".".join(map(str, capability))
        raise DenoiserSettingError(
            FLAG,
            f"{config.attention_backend} needs compute capability {need} or later; {device} has {have}",
        )


def set_attention_backend(pipe: Any, config: DenoiserConfig, device: str) -> None:
    """Route every denoiser's attention through the configured backend. `native` (torch's
    SDPA) is what the models do by default, so nothing is changed for it."""
    if config.attention_backend == "native":
        return
    check_capability(config, device)
    backend = AttentionBackendName(parse_attention_backend(config.attention_backend).dispatcher_name)
    try:
        # The package and its version, as diffusers itself requires them.
        _check_attention_backend_requirements(backend)
    except RuntimeError as exc:
        raise DenoiserSettingError(FLAG, str(exc)) from None
    for name, module in denoisers_of(pipe):
        attentions = (m for m in module.modules() if isinstance(m, Attention | AttentionModuleMixin))
        processors = [m.processor for m in attentions]
        dispatched = any(hasattr(p, "_attention_backend") for p in processors)
        if not isinstance(module, ModelMixin) or not dispatched:
            kinds = ", ".join(sorted({type(p).__name__ for p in processors})) or "none"
            raise DenoiserSettingError(
                FLAG,
                f"{type(module).__name__} ({name}) does not compute attention through diffusers' "
                f"attention dispatcher (its processors: {kinds}); only native serves it",
            )
        module.set_attention_backend(backend.value)
    logger.info("attention backend: %s (%s)", config.attention_backend, backend.value)
