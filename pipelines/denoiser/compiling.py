"""`--compile`: the denoiser compiled with `torch.compile`, regionally (diffusers'
`compile_repeated_blocks`) or whole, so step groups of every size share its graphs.

A step group's rows change whenever a request joins or leaves. Rather than padding groups
to a few bucket sizes (a graph per bucket, and the padded rows paid for on every step), the
row dimension is left to torch's automatic dynamic shapes: the first graph is compiled for
the sizes it meets, and the first time a dimension changes, the graph is compiled again with
that dimension symbolic, for every later size. The warm-up at start
(`pipelines.denoiser.warmup`) meets two row counts above one, so that happens before the
first request; torch keeps a graph of its own for one row (a dimension of 1 is always
specialised). Only dimensions that changed become symbolic, so the image and text
dimensions keep static kernels; a request of another image size compiles once more (and
a second new size makes those dimensions symbolic too), counted in /metrics. Measured on
this CPU (docs/benchmarks.md, "Compiled denoisers"): static shapes compiled 3 graphs for every
row count met; `dynamic=True` (every dimension symbolic from the start) compiled no fewer
graphs than this, and its steps were not faster.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from diffusers import ModelMixin
from torch._dynamo.utils import counters

from pipelines.denoiser.options import CompileMode, DenoiserSettingError

logger = logging.getLogger(__name__)

# The components that are denoisers, in the pipelines this project serves.
DENOISERS = ("transformer", "transformer_2", "unet")


def denoisers_of(pipe: Any) -> list[tuple[str, torch.nn.Module]]:
    """The pipeline's denoiser modules, by component name."""
    found = []
    for name in DENOISERS:
        module = getattr(pipe, name, None)
        if isinstance(module, torch.nn.Module):
            found.append((name, module))
    return found


def compile_denoisers(pipe: Any, mode: CompileMode) -> None:
    """Wrap each denoiser for compilation; nothing compiles until its first call (the
    warm-up at start, `pipelines.denoiser.warmup`)."""
    if mode == "off":
        return
    denoisers = denoisers_of(pipe)
    if not denoisers:
        names = ", ".join(DENOISERS)
        raise DenoiserSettingError("--compile", f"{type(pipe).__name__} has no denoiser ({names})")
    for name, module in denoisers:
        if mode == "full":
            module.compile()
            continue
        if not isinstance(module, ModelMixin) or not getattr(module, "_repeated_blocks", None):
            raise DenoiserSettingError(
                "--compile",
                f"blocks compiles the repeated blocks a diffusers model lists in _repeated_blocks, "
                f"and {type(module).__name__} ({name}) lists none; use --compile full",
            )
        module.compile_repeated_blocks()
    logger.info("denoiser compiled (%s): %s", mode, ", ".join(name for name, _ in denoisers))


def compiled_graphs() -> int:
    """Frames torch.compile has compiled in this process so far: each first compile and each
    recompile (a guard that failed on new shapes) counts one."""
    return int(counters["frames"]["ok"])
