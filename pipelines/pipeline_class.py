"""`--pipeline-class module:Class`: what it must be (a `pipelines.base.Pipeline` subclass),
and how much of that can be checked before anything loads.

Torch-free itself: `check_module` finds the module without running it, so the server
refuses a misspelt path before it listens at no cost; `import_class` imports it, as the
registry does when it loads (a user's module may import torch: that is the import the
load makes anyway). Each refusal is a `PipelineClassError` naming the flag.
"""

from __future__ import annotations

import importlib
import importlib.util

from pipelines.base import Pipeline

FLAG = "--pipeline-class"


class PipelineClassError(ValueError):
    """A `--pipeline-class` that names no pipeline class; the message starts with the flag."""

    def __init__(self, message: str) -> None:
        super().__init__(f"{FLAG}: {message}")
        self.flag = FLAG


def split_spec(spec: str) -> tuple[str, str]:
    """(module, class name) of `module:Class`."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise PipelineClassError(f"must look like 'module:Class', got {spec!r}")
    return module_name, attr


def check_class(spec: str, importing: bool) -> None:
    """What the server checks before it listens: the module exists, and when `importing`
    (the pipeline loads in this process, which imports it anyway) that it holds a pipeline
    class. The project's own paths are the registry's, at load."""
    check_module(spec)
    if importing and not _own(split_spec(spec)[0]):
        import_class(spec)


def _own(module_name: str) -> bool:
    return module_name == "pipelines" or module_name.startswith("pipelines.")


def check_module(spec: str) -> None:
    """The spec's shape, and that its module exists, without running the module (its
    parent packages are imported). The project's own `pipelines.*` paths are left to the
    registry: old ones are aliases of modules that no longer exist."""
    module_name, _ = split_spec(spec)
    if _own(module_name):
        return
    try:
        found = importlib.util.find_spec(module_name)
    except (ImportError, ValueError) as exc:  # a parent package that is missing or broken
        raise PipelineClassError(f"cannot import {module_name}: {exc}") from None
    if found is None:
        raise PipelineClassError(f"no module named {module_name!r}")


def import_class(spec: str) -> type[Pipeline]:
    """Import `module:Class` and check that it is a `Pipeline` subclass."""
    module_name, attr = split_spec(spec)
    try:
        module = importlib.import_module(module_name)
    # Whatever the module raises as it runs, it does not import: the flag is what is wrong.
    except Exception as exc:
        raise PipelineClassError(f"cannot import {module_name}: {type(exc).__name__}: {exc}") from exc
    obj = getattr(module, attr, None)
    if obj is None:
        raise PipelineClassError(f"module {module_name} has no {attr}")
    if not (isinstance(obj, type) and issubclass(obj, Pipeline)):
        raise PipelineClassError(f"{spec} is not a subclass of pipelines.base.Pipeline")
    return obj
