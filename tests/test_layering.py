"""The layering of DESIGN.md, enforced by reading each module's imports."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEAVY = {"torch", "diffusers", "transformers"}
WEB = {"fastapi", "starlette", "uvicorn"}


def imports_of(path: Path) -> set[str]:
    """Top-level names imported by a module, including imports inside functions."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def top(names: set[str]) -> set[str]:
    return {name.split(".")[0] for name in names}


@pytest.mark.parametrize("path", modules("server"), ids=str)
def test_server_never_imports_torch_or_diffusers(path: Path) -> None:
    assert not top(imports_of(path)) & HEAVY


@pytest.mark.parametrize("path", modules("engine"), ids=str)
def test_engine_never_imports_the_web_framework_or_torch(path: Path) -> None:
    names = imports_of(path)
    assert not top(names) & (WEB | HEAVY)
    # Only the executors host a pipeline; they import the registry lazily (the process
    # executor names PipelineConfig for type checking only).
    if path.name not in {"executor.py", "process_executor.py"}:
        assert not any(n.startswith("pipelines") for n in names), names


def test_request_module_is_a_leaf() -> None:
    names = top(imports_of(ROOT / "engine" / "request.py"))
    assert not names & {"engine", "server", "pipelines", *HEAVY}


@pytest.mark.parametrize("path", modules("pipelines"), ids=str)
def test_pipelines_reach_into_engine_only_for_the_request_types(path: Path) -> None:
    engine_imports = {n for n in imports_of(path) if n.split(".")[0] in {"engine", "server"}}
    assert engine_imports <= {"engine.request"}, engine_imports


def test_pipeline_contract_is_torch_free() -> None:
    assert not top(imports_of(ROOT / "pipelines" / "base.py")) & HEAVY


def test_memory_options_are_torch_free() -> None:
    # The server validates memory settings with them before anything loads.
    assert not top(imports_of(ROOT / "pipelines" / "memory" / "options.py")) & HEAVY
