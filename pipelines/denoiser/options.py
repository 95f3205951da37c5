"""How the denoiser runs: compiled (`--compile`) and with which attention kernels
(`--attention-backend`), parsed and checked before anything loads.

Torch-free, so the server refuses a value no device could run at start, naming the flag.
What each setting does to a loaded pipeline is `pipelines.denoiser.compiling`'s and
`pipelines.denoiser.attention`'s; what needs torch or the loaded model (the device's compute
capability, whether the model's attention goes through diffusers' dispatcher) is checked
there, still before the first request.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Literal

CompileMode = Literal["off", "blocks", "full"]
# The keys of `ATTENTION_BACKENDS` (a test holds them equal).
AttentionBackendChoice = Literal[
    "native", "math", "cudnn", "efficient", "flash", "flash3", "sage", "xformers"
]
COMPILE_MODES: tuple[CompileMode, ...] = ("off", "blocks", "full")


@dataclass(frozen=True, slots=True)
class AttentionBackend:
    """One `--attention-backend` choice: diffusers' `AttentionBackendName` value, the Python
    package it needs (None: torch itself), whether it runs on CUDA only, the least compute
    capability it needs there, and the sequence-parallel modes (`--sp-mode`) diffusers
    0.42.1 runs it in: Ulysses where its registry says `supports_context_parallel`, ring
    where its forward also returns the log-sum-exp that merges partial attentions (native's
    refuses `return_lse`). `cpu_sequence_modes`, where they differ on the CPU: there
    diffbatch gives the native backend's ring that log-sum-exp (`pipelines.parallel.ring_cpu`)."""

    dispatcher_name: str
    package: str | None = None
    cuda_only: bool = False
    min_capability: tuple[int, int] = (0, 0)
    sequence_modes: tuple[str, ...] = ()
    cpu_sequence_modes: tuple[str, ...] | None = None

    def sequence_modes_on(self, cpu: bool) -> tuple[str, ...]:
        """The `--sp-mode`s it runs on the CPU (`cpu`) or on CUDA."""
        if cpu and self.cpu_sequence_modes is not None:
            return self.cpu_sequence_modes
        return self.sequence_modes


# Our names for diffusers' backends (`diffusers.models.attention_dispatch`). The hub-kernel
# variants are left out: they download code at start.
ATTENTION_BACKENDS: dict[str, AttentionBackend] = {
    # torch's scaled_dot_product_attention choosing its own kernel: the default.
    "native": AttentionBackend("native", sequence_modes=("ulysses",), cpu_sequence_modes=("ulysses", "ring")),
    # SDPA pinned to one of torch's kernels.
    "math": AttentionBackend("_native_math"),
    "cudnn": AttentionBackend(
        "_native_cudnn", cuda_only=True, min_capability=(8, 0), sequence_modes=("ulysses", "ring")
    ),
    "efficient": AttentionBackend("_native_efficient", cuda_only=True),
    # Packages of their own.
    "flash": AttentionBackend(
        "flash", "flash_attn", cuda_only=True, min_capability=(8, 0), sequence_modes=("ulysses", "ring")
    ),
    "flash3": AttentionBackend("_flash_3", "flash_attn_interface", cuda_only=True, min_capability=(9, 0)),
    "sage": AttentionBackend(
        "sage", "sageattention", cuda_only=True, min_capability=(8, 0), sequence_modes=("ulysses", "ring")
    ),
    "xformers": AttentionBackend("xformers", "xformers", cuda_only=True),
}


class DenoiserSettingError(ValueError):
    """A denoiser setting that cannot be served; the message starts with the flag."""

    def __init__(self, flag: str, message: str) -> None:
        super().__init__(f"{flag}: {message}")
        self.flag = flag


@dataclass(frozen=True, slots=True)
class DenoiserConfig:
    """How the denoiser (transformer, transformer_2 or unet) runs.

    `compile`: off; blocks (regional: diffusers' `compile_repeated_blocks`, each repeated
    transformer block compiled once and reused by every block of its class); full
    (`torch.compile` of the whole denoiser). Either way the row dimension becomes dynamic
    in the warm-up, so step groups of any size share one compiled graph. `warmup_requests`:
    the step-group sizes run on dummy requests at start when compiled (after one request
    without guidance: a single row), so no user pays for a compile; two sizes, so the row
    dimension is seen to change even where a request is one row. `warmup_sizes`: (width,
    height) of other image sizes the warm-up steps a group at, so the image dimensions
    become dynamic too before the first request of another size. `warmup_batching`: the
    path the warm-up runs, step stages or request-level forwards (the server's `--batching`,
    which also decides whether a cache must go through diffusers' hooks: `cache_refusal`).
    `attention_backend`: a key of `ATTENTION_BACKENDS`."""

    compile: CompileMode = "off"
    attention_backend: str = "native"
    warmup_requests: tuple[int, ...] = (2, 3)
    warmup_sizes: tuple[tuple[int, int], ...] = ()
    warmup_batching: Literal["step", "request"] = "step"


def parse_compile(value: str) -> CompileMode:
    for mode in COMPILE_MODES:
        if value == mode:
            return mode
    known = ", ".join(COMPILE_MODES)
    raise DenoiserSettingError("--compile", f"unknown mode {value!r}; choose one of {known}")


def parse_attention_backend(value: str) -> AttentionBackend:
    try:
        return ATTENTION_BACKENDS[value]
    except KeyError:
        known = ", ".join(ATTENTION_BACKENDS)
        raise DenoiserSettingError(
            "--attention-backend", f"unknown backend {value!r}; choose one of {known}"
        ) from None


def check_device(config: DenoiserConfig, device: str) -> None:
    """Refuse what `device` can never run: a CUDA-only attention backend elsewhere. The
    compute capability is read where torch is (`pipelines.denoiser.attention`)."""
    parse_compile(config.compile)
    backend = parse_attention_backend(config.attention_backend)
    if backend.cuda_only and device.split(":", maxsplit=1)[0] != "cuda":
        raise DenoiserSettingError(
            "--attention-backend", f"{config.attention_backend} runs on CUDA only; --device is {device}"
        )


def check_packages(config: DenoiserConfig) -> None:
    """Refuse a backend whose package is not installed here (checked where the model loads:
    settings are also built where none does, a Ray Serve gateway)."""
    backend = parse_attention_backend(config.attention_backend)
    if backend.package is not None and not installed(backend.package):
        raise DenoiserSettingError(
            "--attention-backend",
            f"{config.attention_backend} needs the {backend.package} package, which is not installed",
        )


def installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None
