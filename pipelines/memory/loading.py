"""What `pipelines.loading.load_diffusers` does for memory: the `from_pretrained` arguments
(per-component dtypes, quantization configs, a single-file denoiser), then, once loaded,
layerwise casting, placement (on the device, or offloaded) and bounded VAE decodes.

All of it is diffusers' own machinery working through hooks on the components' modules, so
both batching modes get it: the step stages call the components directly (`pipe.unet(...)`,
`pipe.vae.decode(...)`, `pipe.encode_prompt(...)`), and every such call runs a module's
`forward` (or, for `vae.decode`, diffusers' `apply_forward_hook` and the VAE's group
offload block modules), where the hooks move or cast the weights.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from pathlib import Path
from typing import Any

import torch
from diffusers import DiffusionPipeline

from pipelines.base import PipelineConfig
from pipelines.decode import HalvingDecode
from pipelines.memory.decode_budget import DecodeBudget
from pipelines.memory.dtypes import cast_inputs_of
from pipelines.memory.options import (
    MemorySettingError,
    check_components,
    check_device,
    check_packages,
    check_transformer_file,
)
from pipelines.memory.quantization import (
    cast_layerwise,
    load_transformer_file,
    loaded_index,
    model_index,
    pipeline_quantization,
)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def check_memory(config: PipelineConfig) -> None:
    """Refuse, before loading anything, what this host cannot run (a missing backend
    package, offload or a scheme the device does not have)."""
    check_packages(config.memory)
    check_transformer_file(config.memory)
    check_device(config.memory, config.device)
    if config.memory.offload in ("model", "sequential") and not _has_accelerator(config.device):
        raise MemorySettingError(
            "--offload",
            f"{config.memory.offload} offload needs an accelerator; {config.device} is not available",
        )
    if str(config.memory.quantization) == "torchao:float8wo" and not _has_float8(config.device):
        raise MemorySettingError("--quantization", "torchao:float8wo needs compute capability 8.9 or later")


def pretrained_kwargs(config: PipelineConfig, path: str, dtype: torch.dtype) -> dict[str, Any]:
    """`dtype` (a per-component dict when some components differ), `quantization_config`
    and a replacement denoiser, as `from_pretrained` takes them."""
    memory = config.memory
    kwargs: dict[str, Any] = {"dtype": dtype}
    if not (memory.component_dtypes or memory.quantization or memory.transformer_file):
        return kwargs
    # Every component name is checked against the model index, before the (slow) load.
    index = model_index(path)
    check_components(memory, list(index))
    if memory.component_dtypes:
        kwargs["dtype"] = {"default": dtype, **{name: DTYPES[d] for name, d in memory.component_dtypes}}
    quantization = pipeline_quantization(memory, index, dtype)
    if quantization is not None:
        kwargs["quantization_config"] = quantization
    if memory.transformer_file is not None:
        name, denoiser = load_transformer_file(path, memory, index, dtype)
        kwargs[name] = denoiser
    return kwargs


def fit(pipe: DiffusionPipeline, config: PipelineConfig) -> None:
    """After `from_pretrained`: cast layerwise, place or offload, and bound the VAE's
    decodes (component names were checked before the load, `pretrained_kwargs`)."""
    memory = config.memory
    cast_inputs_of(pipe, list(memory.dtypes))
    if memory.quantization is not None and memory.quantization.backend == "layerwise":
        cast_layerwise(pipe, memory, loaded_index(pipe))
    place(pipe, config)
    vae = getattr(pipe, "vae", None)
    if vae is not None:
        tiling(vae, config)
        if not isinstance(vae.decode, HalvingDecode):
            vae.decode = HalvingDecode(vae.decode, DecodeBudget.of(pipe, config.memory))


def place(pipe: DiffusionPipeline, config: PipelineConfig) -> None:
    """Every component on the device, or offloaded as `--offload` says."""
    memory, device = config.memory, torch.device(config.device)
    if memory.offload == "none":
        pipe.to(device)
    elif memory.offload == "model":
        pipe.enable_model_cpu_offload(device=device)
        one_component_resident(pipe)
    elif memory.offload == "sequential":
        pipe.enable_sequential_cpu_offload(device=device)
    else:
        offload_groups(pipe, device, memory.offload_to_disk)


def one_component_resident(pipe: Any) -> None:
    """Model offload as the step stages need it. accelerate's hooks offload a component only
    when the next one in `model_cpu_offload_seq` runs, and diffusers' `__call__` ends with
    `maybe_free_model_hooks` to offload the rest; the stages never end a call, so a prepare's
    text encoder (first in the sequence: no component before it to offload) ran beside the
    resident denoiser, and FLUX's T5 and transformer were on the device together. So every
    component's forward first offloads the others (looked up at call time: diffusers renews
    its hooks after each `__call__`). A VAE decode needs nothing more: the VAE follows the
    denoiser in the sequence, so its own hook offloads it."""
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            component.register_forward_pre_hook(_offload_others(pipe, component))


def _offload_others(pipe: Any, component: torch.nn.Module) -> Any:
    def offload(_module: torch.nn.Module, _args: Any) -> None:
        for hook in getattr(pipe, "_all_hooks", ()):
            if hook.model is not component:
                hook.offload()  # a component already off the device is only walked

    return offload


def offload_groups(pipe: DiffusionPipeline, device: torch.device, to_disk: str | None) -> None:
    """`DiffusionPipeline.enable_group_offload`, block level, one block per group, with one
    repair: a VAE that declares no block modules (Qwen-Image's) would be one group onloaded
    by its own `forward`, which `vae.decode` never calls, so its weights stayed offloaded
    (on disk: empty, and the images NaN, in the stock pipeline too). Its children are its
    blocks instead, as diffusers declares them for AutoencoderKL and Wan's VAE."""
    from diffusers.hooks import apply_group_offloading

    directory = None if to_disk is None else own_directory(pipe, to_disk)
    for name, component in pipe.components.items():
        if not isinstance(component, torch.nn.Module):
            continue
        blocks = getattr(component, "_group_offload_block_modules", None)
        if blocks is None and callable(getattr(component, "decode", None)):
            blocks = [name for name, child in component.named_children() if _has_parameters(child)]
        apply_group_offloading(
            component,
            onload_device=device,
            offload_device=torch.device("cpu"),
            offload_type="block_level",
            num_blocks_per_group=1,
            # A side stream prefetches the next block while this one runs: CUDA only.
            use_stream=device.type == "cuda",
            offload_to_disk_path=None if directory is None else f"{directory}/{name}",
            block_modules=blocks,
        )


def own_directory(pipe: Any, path: str) -> str:
    """A fresh directory under `--offload-to-disk` for this load's block files, removed
    with the pipeline (or when its process exits: spawned workers exit through `sys.exit`).
    diffusers writes a block's file only where none exists and names it by the block, not
    the weights: on a shared directory a restart with other weights or quantization read
    the old files, and two workers or replicas raced on the same ones."""
    Path(path).mkdir(parents=True, exist_ok=True)
    directory = tempfile.mkdtemp(prefix=f"load-{os.getpid()}-", dir=path)
    # Run by `release` at shutdown; else when the pipeline is collected or the process
    # exits normally (a server stopped by SIGTERM ends by the signal: no exit handlers).
    pipe._offload_files = weakref.finalize(pipe, shutil.rmtree, directory, ignore_errors=True)
    return directory


def release(pipe: Any) -> None:
    """Remove the pipeline's offload files now (`Pipeline.close`); idempotent."""
    files = getattr(pipe, "_offload_files", None)
    if files is not None:
        files()


def tiling(vae: Any, config: PipelineConfig) -> None:
    """`--vae-tiling on`: diffusers' tiled decode for every image above the VAE's tile size
    (it decodes smaller ones whole). `auto` leaves it to the decode budget, which tiles only
    decodes of one image that alone exceeds it; `off` never tiles."""
    wanted = config.memory.vae_tiling
    if wanted == "off":
        return
    if not hasattr(vae, "enable_tiling"):
        if wanted == "on":
            raise MemorySettingError("--vae-tiling", f"{type(vae).__name__} has no tiled decode")
        return
    if wanted == "on":
        vae.enable_tiling()


def _has_float8(device: str) -> bool:
    """float8 matmuls: CUDA compute capability 8.9 (Ada, Hopper) and later."""
    return _has_accelerator(device) and torch.cuda.get_device_capability(device) >= (8, 9)


def _has_parameters(module: torch.nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _has_accelerator(device: str) -> bool:
    kind = torch.device(device).type
    if kind == "cuda":
        return torch.cuda.is_available()
    accelerator = getattr(torch, kind, None)
    available = getattr(accelerator, "is_available", None)
    return bool(available()) if callable(available) else kind != "cpu"
