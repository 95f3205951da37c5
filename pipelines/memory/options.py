"""The memory settings of one served model, parsed and checked before anything loads.

Torch-free, so the server validates flags and YAML with it at start: a bad value is refused
with a message naming the flag, and nothing is served half-loaded. What each setting does
to the loaded pipeline is `pipelines.memory.loading`'s.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Offload = Literal["none", "model", "group", "sequential"]
VaeTiling = Literal["auto", "on", "off"]

DTYPES = ("float32", "float16", "bfloat16")
# backend -> schemes; each backend's Python package (None: diffusers itself).
SCHEMES: dict[str, tuple[str, ...]] = {
    "torchao": ("int8wo", "float8wo"),
    "bitsandbytes": ("nf4", "int8"),
    "layerwise": ("float8_e4m3fn", "float8_e5m2"),
}
PACKAGES: dict[str, str | None] = {"torchao": "torchao", "bitsandbytes": "bitsandbytes", "layerwise": None}
# Where the scheme can run at all: bitsandbytes' kernels are CUDA's; torchao's float8 needs
# float8 matmuls (compute capability 8.9 and up, checked when it loads).
NEEDS_CUDA = {("bitsandbytes", "nf4"), ("bitsandbytes", "int8"), ("torchao", "float8wo")}
# A GGUF file is read by the `gguf` package (diffusers' GGUFQuantizationConfig).
GGUF_PACKAGE = "gguf"
# What a GGUF file starts with (the format's magic number); a safetensors file starts with
# its JSON header's length (8 bytes, little-endian), then the header's "{".
GGUF_MAGIC = b"GGUF"
# The pip extra that installs each package (pyproject.toml).
EXTRAS = {"torchao": "torchao", "bitsandbytes": "bitsandbytes", "gguf": "gguf"}


class MemorySettingError(ValueError):
    """A memory setting that cannot be served; the message starts with the flag."""

    def __init__(self, flag: str, message: str) -> None:
        super().__init__(f"{flag}: {message}")
        self.flag = flag


@dataclass(frozen=True, slots=True)
class Quantization:
    """`--quantization BACKEND:SCHEME`, e.g. `torchao:int8wo` or `layerwise:float8_e4m3fn`."""

    backend: str
    scheme: str

    def __str__(self) -> str:
        return f"{self.backend}:{self.scheme}"


@dataclass(frozen=True, slots=True)
class MemoryConfig:
    """How one model is fitted into memory.

    `component_dtypes`: (component, dtype) pairs that override `PipelineConfig.dtype` for
    those components (Wan's VAE in float32). `offload`: none, model (whole components move
    to the device when called, `enable_model_cpu_offload`), group (block by block,
    `apply_group_offloading`; to `offload_to_disk` files when set) or sequential (leaf by
    leaf, `enable_sequential_cpu_offload`). `quantization`: the weights' storage, for
    `quantize_components` (default: the denoiser). `transformer_file`: a single-file
    (GGUF or safetensors) denoiser replacing the model's own. `decode_budget`: most images x
    pixels (videos: frames x pixels) one VAE decode may hold; `vae_tiling`: diffusers'
    tiled VAE decode, on, off, or auto (on above `TILING_PIXELS` per image)."""

    component_dtypes: tuple[tuple[str, str], ...] = ()
    offload: Offload = "none"
    offload_to_disk: str | None = None
    quantization: Quantization | None = None
    quantize_components: tuple[str, ...] = ()
    transformer_file: str | None = None
    decode_budget: int | None = None
    vae_tiling: VaeTiling = "auto"

    @property
    def dtypes(self) -> dict[str, str]:
        return dict(self.component_dtypes)


def parse_component_dtypes(value: Mapping[str, str] | Iterable[str] | str) -> tuple[tuple[str, str], ...]:
    """`{vae: float32}` (YAML), `["vae=float32", ...]` (repeated flags) or `"vae=float32,..."`
    (an environment variable) as sorted pairs."""
    flag = "--component-dtypes"
    if isinstance(value, str):
        value = [part for part in value.replace(" ", ",").split(",") if part]
    if isinstance(value, Mapping):
        pairs = [(str(name), str(dtype)) for name, dtype in value.items()]
    else:
        pairs = []
        for item in value:
            name, sep, dtype = str(item).partition("=")
            if not sep or not name.strip() or not dtype.strip():
                raise MemorySettingError(flag, f"write each as COMPONENT=DTYPE (vae=float32), got {item!r}")
            pairs.append((name.strip(), dtype.strip()))
    names = [name for name, _ in pairs]
    if len(set(names)) < len(names):
        raise MemorySettingError(flag, "each component may be given once")
    for name, dtype in pairs:
        if dtype not in DTYPES:
            raise MemorySettingError(flag, f"{name}={dtype}: the dtype must be one of {', '.join(DTYPES)}")
    return tuple(sorted(pairs))


def parse_quantization(value: str) -> Quantization:
    """`BACKEND:SCHEME`, checked against `SCHEMES`."""
    flag = "--quantization"
    backend, sep, scheme = value.strip().partition(":")
    known = ", ".join(f"{b}:{s}" for b, schemes in SCHEMES.items() for s in schemes)
    if not sep or backend not in SCHEMES:
        raise MemorySettingError(flag, f"unknown quantization {value!r}; choose one of {known}")
    if scheme not in SCHEMES[backend]:
        raise MemorySettingError(flag, f"unknown {backend} scheme {scheme!r}; choose one of {known}")
    return Quantization(backend, scheme)


def check_packages(memory: MemoryConfig) -> None:
    """Refuse a backend whose package is not installed, naming the flag and the extra."""
    quantization = memory.quantization
    if quantization is not None:
        package = PACKAGES[quantization.backend]
        if package is not None and not installed(package):
            raise MemorySettingError(
                "--quantization",
                f"{quantization} needs the {package} package, which is not installed "
                f"(pip install 'diffbatch[{EXTRAS[package]}]')",
            )
    file = memory.transformer_file
    if file is not None and file.endswith(".gguf") and not installed(GGUF_PACKAGE):
        raise MemorySettingError(
            "--transformer-file",
            f"reading {file} needs the gguf package, which is not installed (pip install 'diffbatch[gguf]')",
        )


def check_transformer_file(memory: MemoryConfig) -> None:
    """Refuse a `--transformer-file` that is missing, or is not what its name says (GGUF for
    `.gguf`, else safetensors), by its first bytes: before the slow load, which would fail
    deep in diffusers. A URL is left to diffusers, which downloads it."""
    flag, file = "--transformer-file", memory.transformer_file
    if file is None or "://" in file:
        return
    path = Path(file).expanduser()
    if not path.is_file():
        raise MemorySettingError(flag, f"{file}: no such file")
    try:
        with path.open("rb") as handle:
            head = handle.read(9)
    except OSError as exc:
        raise MemorySettingError(flag, f"{file} cannot be read ({exc.strerror})") from None
    if file.endswith(".gguf"):
        if not head.startswith(GGUF_MAGIC):
            raise MemorySettingError(flag, f"{file} is not a GGUF file (it does not start with GGUF)")
    elif not _is_safetensors(head, path.stat().st_size):
        raise MemorySettingError(flag, f"{file} is neither a GGUF file (named .gguf) nor a safetensors file")


def _is_safetensors(head: bytes, size: int) -> bool:
    return len(head) == 9 and head[8:] == b"{" and int.from_bytes(head[:8], "little") < size


def check_components(memory: MemoryConfig, components: Collection[str]) -> None:
    """Refuse a component name the model does not have (`components`: its model index's)."""
    for flag, names in (
        ("--component-dtypes", [name for name, _ in memory.component_dtypes]),
        ("--quantize-components", memory.quantize_components),
    ):
        if unknown := [name for name in names if name not in components]:
            raise MemorySettingError(
                flag, f"the model has no component {unknown[0]!r}; it has {', '.join(sorted(components))}"
            )


def check_device(memory: MemoryConfig, device: str) -> None:
    """Refuse what the device cannot run: model and sequential offload move weights between
    the host and an accelerator (on the CPU there is nowhere to move them), and CUDA-only
    quantization schemes."""
    on_cpu = device.split(":", maxsplit=1)[0] == "cpu"
    if on_cpu and memory.offload in ("model", "sequential"):
        raise MemorySettingError(
            "--offload",
            f"{memory.offload} offload moves weights between the CPU and an accelerator, and "
            "--device is cpu; use --offload group with --offload-to-disk PATH to hold weights "
            "on disk, or none",
        )
    if memory.offload_to_disk is not None and memory.offload != "group":
        raise MemorySettingError("--offload-to-disk", "goes with --offload group")
    if on_cpu and memory.offload == "group" and memory.offload_to_disk is None:
        raise MemorySettingError(
            "--offload",
            "group offload on the CPU would move weights from the CPU to the CPU; add "
            "--offload-to-disk PATH (weights read from disk block by block)",
        )
    quantization = memory.quantization
    if quantization is not None and on_cpu and (quantization.backend, quantization.scheme) in NEEDS_CUDA:
        raise MemorySettingError("--quantization", f"{quantization} runs on CUDA only; --device is cpu")


def installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None
