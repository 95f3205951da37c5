"""The layering of DESIGN.md, enforced by reading each module's imports (top-level, inside
functions and under `TYPE_CHECKING` alike: a lazy import is still an arrow)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.imports import ROOT, imported_names, module_name

HEAVY = {"torch", "diffusers", "transformers"}
WEB = {"fastapi", "starlette", "uvicorn"}

# engine/'s layers, top to bottom: a module imports only its own layer or those below.
# The leaves (engine/'s root modules: request.py, spec.py, outputs.py, errors.py) are the
# shared plain types every layer reads.
ENGINE_LAYERS = ("models", "core", "executor", "worker", "sched")
LEAF = len(ENGINE_LAYERS)


def modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def top(names: set[str]) -> set[str]:
    return {name.split(".")[0] for name in names}


def engine_layer(module: str) -> int:
    """0 for models/ (the top) down to LEAF for engine/'s root modules."""
    parts = module.split(".")
    if len(parts) > 2 and parts[1] in ENGINE_LAYERS:
        return ENGINE_LAYERS.index(parts[1])
    if len(parts) == 2 and parts[1] in ENGINE_LAYERS:  # a layer's package itself
        return ENGINE_LAYERS.index(parts[1])
    return LEAF


@pytest.mark.parametrize("path", modules("server"), ids=str)
def test_server_never_imports_torch_or_diffusers(path: Path) -> None:
    assert not top(imported_names(path)) & HEAVY


@pytest.mark.parametrize("path", modules("server/routes"), ids=str)
def test_routes_do_not_import_each_other(path: Path) -> None:
    """What two routes share lives below them (`server/image_answer.py`), not in one of them."""
    routes = sorted(n for n in imported_names(path) if n.startswith("server.routes."))
    assert not routes, f"{module_name(path)} imports {routes}"


@pytest.mark.parametrize("path", modules("engine"), ids=str)
def test_engine_never_imports_the_web_framework_torch_or_pipelines(path: Path) -> None:
    names = imported_names(path)
    assert not top(names) & (WEB | HEAVY)
    # What the engine needs of a pipeline is a Protocol of its own; the server's
    # composition root loads pipelines and hands them in.
    assert "pipelines" not in top(names), names


@pytest.mark.parametrize("path", modules("engine"), ids=str)
def test_engine_imports_point_down_its_layers(path: Path) -> None:
    """models → core → executor → worker → sched → the leaves: no arrow back up."""
    own = engine_layer(module_name(path))
    upward = sorted(
        name for name in imported_names(path) if name.split(".")[0] == "engine" and engine_layer(name) < own
    )
    assert not upward, (
        f"{module_name(path)} (layer {ENGINE_LAYERS[own] if own < LEAF else 'leaf'}) imports {upward}"
    )


@pytest.mark.parametrize("path", sorted((ROOT / "engine").glob("*.py")), ids=str)
def test_engine_root_modules_are_leaves(path: Path) -> None:
    """The shared plain types import no torch and nothing of the project but each other."""
    names = imported_names(path)
    assert not top(names) & {"server", "pipelines", *HEAVY}
    assert all(engine_layer(n) == LEAF for n in names if n.split(".")[0] == "engine"), names


def test_request_module_is_a_leaf() -> None:
    names = top(imported_names(ROOT / "engine" / "request.py"))
    assert not names & {"engine", "server", "pipelines", *HEAVY}


@pytest.mark.parametrize("path", modules("pipelines"), ids=str)
def test_pipelines_reach_into_engine_only_for_the_request_types(path: Path) -> None:
    names = {n for n in imported_names(path) if n.split(".")[0] in {"engine", "server"}}
    assert all(n == "engine.request" or n.startswith("engine.request.") for n in names), names


def test_pipeline_contract_is_torch_free() -> None:
    assert not top(imported_names(ROOT / "pipelines" / "base.py")) & HEAVY


def test_memory_options_are_torch_free() -> None:
    # The server validates memory settings with them before anything loads.
    assert not top(imported_names(ROOT / "pipelines" / "memory" / "options.py")) & HEAVY


def test_layer_rule_catches_an_arrow_up() -> None:
    """The rule itself: a worker module importing the core is an arrow up; the reverse and
    the leaves are not."""
    assert engine_layer("engine.core.engine") < engine_layer("engine.worker.forward")
    assert engine_layer("engine.sched") == ENGINE_LAYERS.index("sched")
    assert engine_layer("engine.request") == LEAF
    assert engine_layer("engine") == LEAF
