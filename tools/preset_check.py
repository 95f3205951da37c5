"""How far a preset loads without its weights: a config-only model directory, and the loading
path's checks run on it, so that a typo in a preset fails a test on any machine.

`config_only_directory` writes the model's `model_index.json` (`tools.presets`) and each
component's configuration files, taken from the tiny model (or the embedded model itself)
that has a component of the same class, weights left out. `check_offline` then runs what
`pipelines.registry.load_pipeline` and `pipelines.loading.load_diffusers` would, up to the
point where weights are read:

- the adapter: the preset's `pipeline_class` imports and its family serves the model index's
  class, or the registry picks one for that class (a family, else the generic adapter,
  whose signature check must accept the class);
- the model index: diffusers reads it (`DiffusionPipeline.load_config`), its class is a
  pipeline class installed here, its components are the ones that class's `__init__`
  takes (every required one present), and each component's class resolves in its library
  as `from_pretrained` resolves it;
- each component's configuration: diffusers components load theirs (`load_config`),
  schedulers are built from theirs, transformers models load their config class;
- the schedule: a configured `scheduler` is built from the model's scheduler config and
  tried with the fixed `timesteps`, which the pipeline's call must take;
- memory: the components named by `component_dtypes` and `quantize_components` exist, and
  the `from_pretrained` arguments (dtype per component, the quantization config of each
  component) are built as the loader builds them; a GGUF `transformer_file` is not read.

What it cannot check without weights: shapes (a checkpoint that does not match its config),
the weights' dtype, and anything decided on the device (offload, float8 support).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import diffusers
from diffusers import DiffusionPipeline

from pipelines.base import PipelineConfig
from pipelines.loading import resolve_model_path, torch_dtype
from pipelines.memory.loading import pretrained_kwargs
from pipelines.memory.quantization import quantized_components
from pipelines.tiny import TINY_MODELS, tiny_model_dir
from tools.presets import model_index

_WEIGHTS = {".safetensors", ".bin", ".gguf", ".pt", ".pth", ".ckpt", ".onnx", ".msgpack"}


def components(index: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """The index's components that load something: name -> (library, class)."""
    return {
        name: (value[0], value[1])
        for name, value in index.items()
        if not name.startswith("_") and isinstance(value, list) and len(value) == 2 and value[0] is not None
    }


def _sources(model: str) -> list[Path]:
    """Directories whose component configs may stand in for the model's: its own where it is
    local (an embedded model), then every tiny model's."""
    own = Path(resolve_model_path(model))
    local = [own] if (own / "model_index.json").is_file() else []
    return local + [tiny_model_dir(name) for name in TINY_MODELS]


def _source_of(name: str, entry: tuple[str, str], sources: list[Path]) -> Path | None:
    """A component folder of class `entry`: one of the same name first, else any."""
    found: list[tuple[bool, Path]] = []
    for directory in sources:
        for other, other_entry in components(
            json.loads((directory / "model_index.json").read_text())
        ).items():
            if other_entry[1] == entry[1] and (directory / other).is_dir():
                found.append((other != name, directory / other))
    return min(found, key=lambda item: item[0])[1] if found else None


def config_only_directory(model: str, target: Path) -> Path:
    """`target` with `model`'s index and its components' configuration files, no weights.
    A component no embedded model has a folder for gets none (its class is still checked)."""
    index = model_index(model)
    if index is None:
        raise ValueError(f"no model index known for {model!r}")
    target.mkdir(parents=True, exist_ok=True)
    (target / "model_index.json").write_text(json.dumps(index, indent=2))
    sources = _sources(model)
    for name, entry in components(index).items():
        source = _source_of(name, entry, sources)
        if source is None:
            continue
        for path in source.rglob("*"):
            if path.is_file() and path.suffix not in _WEIGHTS:
                destination = target / name / path.relative_to(source)
                destination.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(path, destination)
    return target


def component_class(library: str, class_name: str) -> Any:
    """The class `from_pretrained` would load a component with (diffusers' own lookup)."""
    from diffusers.pipelines.pipeline_loading_utils import (
        ALL_IMPORTABLE_CLASSES,
        get_class_obj_and_candidates,
    )

    is_pipeline_module = hasattr(diffusers.pipelines, library)
    cls, _ = get_class_obj_and_candidates(
        library, class_name, ALL_IMPORTABLE_CLASSES, diffusers.pipelines, is_pipeline_module
    )
    return cls


def check_index(directory: Path) -> dict[str, Any]:
    """The index as diffusers reads it, checked against its pipeline class and libraries."""
    index: dict[str, Any] = dict(DiffusionPipeline.load_config(str(directory)))
    class_name = index["_class_name"]
    pipeline = getattr(diffusers, class_name, None)
    if not (isinstance(pipeline, type) and issubclass(pipeline, DiffusionPipeline)):
        raise ValueError(f"{class_name} is not a diffusers pipeline class installed here")
    expected, optional = DiffusionPipeline._get_signature_keys(pipeline)
    named = {name for name in index if not name.startswith("_")}
    if unknown := named - set(expected) - set(optional):
        raise ValueError(f"{class_name} takes no component {sorted(unknown)[0]!r}")
    required = set(expected) - set(getattr(pipeline, "_optional_components", ()))
    if missing := required - named:
        raise ValueError(f"the index of {class_name} lacks its component {sorted(missing)[0]!r}")
    for name, (library, component) in components(index).items():
        cls = component_class(library, component)
        _check_config(cls, directory / name)
    return index


def _check_config(cls: Any, folder: Path) -> None:
    """Load a component's configuration (and build a scheduler from it) where one was written."""
    if not folder.is_dir():
        return
    from diffusers import SchedulerMixin
    from diffusers.configuration_utils import ConfigMixin

    if issubclass(cls, ConfigMixin):
        config = cls.load_config(str(folder))
        if issubclass(cls, SchedulerMixin):
            cls.from_config(config)
        return
    config_class = getattr(cls, "config_class", None)
    if config_class is not None and (folder / "config.json").is_file():
        config_class.from_pretrained(str(folder))


def check_memory_settings(config: PipelineConfig, directory: Path) -> dict[str, Any]:
    """The memory settings against the index, and `from_pretrained`'s arguments as the loader
    builds them (the quantization config per component); a `transformer_file` is not read."""
    memory = config.memory
    index = components(json.loads((directory / "model_index.json").read_text()))
    if unknown := [name for name, _ in memory.component_dtypes if name not in index]:
        raise ValueError(f"component_dtypes: the model has no component {unknown[0]!r}")
    if memory.quantization is not None:
        quantized_components(memory, {name: list(entry) for name, entry in index.items()})
    if memory.transformer_file is not None:
        return {}
    return pretrained_kwargs(config, str(directory), torch_dtype(config))


def check_adapter(config: PipelineConfig, class_name: str) -> type:
    """The adapter the registry would load the model with: the preset's `pipeline_class`,
    whose family must serve the index's class, else the registry's choice for the class."""
    from pipelines.generic import GenericAdapter, GenericPipelineError, pipeline_class
    from pipelines.generic_call import CallSignature
    from pipelines.registry import adapter_for_model, import_pipeline_class

    if config.pipeline_class:
        cls = import_pipeline_class(config.pipeline_class)
        family = getattr(cls, "family_class", None)
        serves = {use.diffusers_class for use in getattr(family, "uses", ())}
        if serves and class_name not in serves:
            raise ValueError(f"{config.pipeline_class} serves {', '.join(sorted(serves))}, not {class_name}")
        return cls
    cls = adapter_for_model(class_name)
    if cls is GenericAdapter:
        refusal = CallSignature.of(pipeline_class(class_name)).refusal
        if refusal is not None:
            raise GenericPipelineError(class_name, refusal)
    return cls


def configs_of(directory: Path) -> Any:
    """A pipeline's configs as a family's checks (`Family.steps()`, `takes_controlnet()`) read
    them, without weights: `pipe.config` is the model index and `pipe.<component>.config` the
    component's config."""
    from diffusers.configuration_utils import FrozenDict

    components = {}
    # Models save `config.json`; guiders (HunyuanVideo 1.5) `guider_config.json`; schedulers
    # (whose kind LTX-2's check reads) `scheduler_config.json`.
    names = ("config.json", "guider_config.json", "scheduler_config.json")
    for path in sorted(path for name in names for path in directory.glob(f"*/{name}")):
        components[path.parent.name] = SimpleNamespace(config=FrozenDict(json.loads(path.read_text())))
    index = json.loads((directory / "model_index.json").read_text())
    return SimpleNamespace(config=FrozenDict(index), **components)


def check_controlnets(config: PipelineConfig, adapter: type, directory: Path) -> None:
    """A preset's ControlNets go beside a model whose family takes them at its use, as the
    adapter checks at load (`Family.takes_controlnet`); the ControlNets' own weights and
    configs are not read."""
    if not config.controlnets:
        return
    shell = _family_shell(adapter, directory)
    if shell is None or not shell.takes_controlnet():
        raise ValueError(f"controlnet: {adapter.__name__} takes no ControlNet")


def check_ip_adapters(config: PipelineConfig, adapter: type, directory: Path) -> None:
    """A preset's IP-Adapters go beside a model whose family takes them at its use
    (`Family.takes_ip_adapter`), and each source names a weights file as `--ip-adapter` reads
    it (`pipelines.ip_adapter.weights_location`) or a FLUX Redux prior beside a family that
    takes one (`Family.takes_redux`); the weights themselves are not read."""
    if not config.ip_adapters:
        return
    from pipelines.ip_adapter import weights_location
    from pipelines.redux_flux import is_redux_source

    redux = [source for _, source in config.ip_adapters if is_redux_source(source)]
    for _, source in config.ip_adapters:
        if source not in redux:
            weights_location(source)
    shell = _family_shell(adapter, directory)
    if shell is None or not shell.takes_ip_adapter():
        raise ValueError(f"ip_adapter: {adapter.__name__} takes no IP-Adapter")
    if redux and not shell.takes_redux():
        raise ValueError(f"ip_adapter: {adapter.__name__} takes no FLUX Redux ({redux[0]})")


def _family_shell(adapter: type, directory: Path) -> Any:
    """The adapter's family without weights (its pipe the preset's configs, its use the
    adapter's), to ask what it takes; None for an adapter of no family."""
    family = getattr(adapter, "family_class", None)
    if family is None:
        return None
    shell = object.__new__(family)
    shell.pipe, shell.use = configs_of(directory), adapter.use  # type: ignore[attr-defined]
    return shell


def check_schedule(config: PipelineConfig, directory: Path) -> None:
    """The configured scheduler built from the model's scheduler config and tried with the
    fixed timesteps (`pipelines.schedule`), and the pipeline's call takes them."""
    if not (config.scheduler or config.timesteps):
        return
    import inspect

    from pipelines.schedule import configured_scheduler

    index = json.loads((directory / "model_index.json").read_text())
    library, name = index["scheduler"]
    template = component_class(library, name).from_pretrained(str(directory / "scheduler"))
    configured_scheduler(template, config)
    pipeline = getattr(diffusers, index["_class_name"])
    if config.timesteps and "timesteps" not in inspect.signature(pipeline.__call__).parameters:
        raise ValueError(f"timesteps: {index['_class_name']}'s call takes no fixed timesteps")
