"""Quantized weights through diffusers' own machinery: `PipelineQuantizationConfig` with a
per-component config (torchao, bitsandbytes) given to `from_pretrained`, layerwise casting
(`enable_layerwise_casting`) applied after the load, and single-file denoisers (GGUF with
`GGUFQuantizationConfig`) loaded with `from_single_file`.

Backends whose packages are missing never reach here: `options.check_packages` refuses them
at start.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers import DiffusionPipeline

from pipelines.memory.options import MemoryConfig, MemorySettingError, Quantization

# The denoisers: what is quantized when `--quantize-components` names nothing.
DENOISERS = ("transformer", "transformer_2", "unet")
_FLOAT8 = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}


def model_index(path: str) -> dict[str, Any]:
    """The model's `model_index.json`: component -> [library, class]."""
    index: dict[str, Any] = DiffusionPipeline.load_config(path)
    return {name: value for name, value in index.items() if isinstance(value, list) and len(value) == 2}


def quantized_components(memory: MemoryConfig, index: dict[str, Any]) -> list[str]:
    """The components to quantize, checked against the model's."""
    if memory.quantize_components:
        if missing := [name for name in memory.quantize_components if name not in index]:
            raise MemorySettingError(
                "--quantize-components",
                f"the model has no component {missing[0]!r}; it has {', '.join(sorted(index))}",
            )
        return list(memory.quantize_components)
    return [name for name in DENOISERS if name in index and index[name][0] is not None]


def pipeline_quantization(memory: MemoryConfig, index: dict[str, Any], dtype: torch.dtype) -> Any | None:
    """The `quantization_config` for `from_pretrained` (None: layerwise casting, which is
    applied after the load, or no quantization)."""
    quantization = memory.quantization
    if quantization is None or quantization.backend == "layerwise":
        return None
    from diffusers import PipelineQuantizationConfig

    mapping = {
        name: _component_config(quantization, index[name][0], dtype)
        for name in quantized_components(memory, index)
    }
    return PipelineQuantizationConfig(quant_mapping=mapping)


def _component_config(quantization: Quantization, library: str, dtype: torch.dtype) -> Any:
    """One component's quantization config, from the library that loads it (diffusers
    models and transformers models each take their own library's config classes)."""
    if library == "transformers":
        import transformers as configs
    else:
        import diffusers as configs
    if quantization.backend == "torchao":
        from torchao.quantization import Float8WeightOnlyConfig, Int8WeightOnlyConfig

        scheme = Int8WeightOnlyConfig() if quantization.scheme == "int8wo" else Float8WeightOnlyConfig()
        return configs.TorchAoConfig(quant_type=scheme)
    if quantization.scheme == "nf4":
        return configs.BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype
        )
    return configs.BitsAndBytesConfig(load_in_8bit=True)


def quantize_built(pipe: DiffusionPipeline, memory: MemoryConfig) -> None:
    """torchao's scheme applied in place to a pipeline built in memory rather than loaded
    with `from_pretrained` (the benchmarks' random-weight models), with `quantize_`, the
    call diffusers' torchao quantizer itself makes on each loaded model. A pipeline loaded
    from files is quantized by its `quantization_config` instead: not this."""
    quantization = memory.quantization
    if quantization is None or quantization.backend != "torchao":
        return
    from torchao.quantization import Float8WeightOnlyConfig, Int8WeightOnlyConfig, quantize_

    scheme = Int8WeightOnlyConfig() if quantization.scheme == "int8wo" else Float8WeightOnlyConfig()
    for name in quantized_components(memory, loaded_index(pipe)):
        quantize_(getattr(pipe, name), scheme)


def loaded_index(pipe: DiffusionPipeline) -> dict[str, Any]:
    """`model_index.json`'s view of a loaded pipeline: component -> [library, class]."""
    return {
        name: [type(component).__module__.split(".")[0], type(component).__name__]
        for name, component in pipe.components.items()
        if component is not None
    }


def cast_layerwise(pipe: DiffusionPipeline, memory: MemoryConfig, index: dict[str, Any]) -> None:
    """Store the chosen components' weights in float8 and compute in their own dtype: each
    layer is upcast as it runs (diffusers' layerwise casting hooks, on each layer's forward,
    so the step stages' direct calls get them too). Norms, embeddings and positional layers
    stay in their dtype (diffusers' default skip patterns)."""
    quantization = memory.quantization
    if quantization is None or quantization.backend != "layerwise":
        return
    from diffusers.hooks import apply_layerwise_casting
    from diffusers.hooks.layerwise_casting import DEFAULT_SKIP_MODULES_PATTERN

    storage = _FLOAT8[quantization.scheme]
    for name in quantized_components(memory, index):
        component = getattr(pipe, name)
        compute = next(component.parameters()).dtype
        if hasattr(component, "enable_layerwise_casting"):  # diffusers models: their own skips
            component.enable_layerwise_casting(storage_dtype=storage, compute_dtype=compute)
        else:
            apply_layerwise_casting(
                component, storage, compute, skip_modules_pattern=DEFAULT_SKIP_MODULES_PATTERN
            )


def load_transformer_file(
    path: str, memory: MemoryConfig, index: dict[str, Any], dtype: torch.dtype
) -> tuple[str, Any]:
    """(component name, the denoiser) from `--transformer-file`: GGUF (kept quantized as
    stored, computed in `dtype`) or a single safetensors file (original or diffusers keys),
    built on the model's own denoiser config."""
    file = memory.transformer_file
    assert file is not None
    name = next((name for name in DENOISERS if name in index), None)
    if name is None:
        raise MemorySettingError("--transformer-file", "the model has no transformer or unet to replace")
    import diffusers

    cls = getattr(diffusers, index[name][1])
    if not hasattr(cls, "from_single_file"):
        raise MemorySettingError(
            "--transformer-file", f"diffusers cannot load {index[name][1]} from a single file"
        )
    options: dict[str, Any] = {"config": path, "subfolder": name, "torch_dtype": dtype}
    if file.endswith(".gguf"):
        options["quantization_config"] = diffusers.GGUFQuantizationConfig(compute_dtype=dtype)
    try:
        return name, cls.from_single_file(file, **options)
    # A file of another architecture fails anywhere in diffusers' key conversion (IndexError,
    # KeyError, shape mismatches...): whatever it raises, the file is what is wrong.
    except Exception as exc:
        raise MemorySettingError(
            "--transformer-file", f"{file} does not load as this model's {index[name][1]}: {exc}"
        ) from exc
