"""The layers inside `pipelines/`, read from each module's imports (those inside functions and
under TYPE_CHECKING included): the folders of parts sit below the modules that drive them,
and the runtime package reaches neither the benchmarks nor the repository's tooling."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# The folders of parts: what the adapter, its stages and the registry put together.
LOWER = ("cache", "denoiser", "families", "memory", "stepping", "tasks", "tiny", "trained")
# What puts them together: nothing below may import it back.
ABOVE = {"pipelines.step_level", "pipelines.adapter", "pipelines.registry", "pipelines.generic"}


def imported(path: Path) -> set[str]:
    """Every module a file imports, `from pipelines import step_level` as `pipelines.step_level`."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def lower_modules() -> list[Path]:
    return sorted(path for folder in LOWER for path in (ROOT / "pipelines" / folder).rglob("*.py"))


@pytest.mark.parametrize("path", lower_modules(), ids=lambda path: str(path.relative_to(ROOT)))
def test_the_parts_never_import_what_drives_them(path: Path) -> None:
    assert not imported(path) & ABOVE


@pytest.mark.parametrize(
    "path", sorted((ROOT / "pipelines").rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT))
)
def test_the_runtime_package_imports_no_bench_and_no_tooling(path: Path) -> None:
    assert not {name.split(".")[0] for name in imported(path)} & {"bench", "tools", "server"}


@pytest.mark.parametrize(
    "path", sorted((ROOT / "pipelines" / "stepping").rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT))
)
def test_the_step_machinery_is_below_the_families_and_tasks_it_serves(path: Path) -> None:
    """Families and tasks build on `pipelines.stepping`; the stages that drive a family and a
    task together are `pipelines.step_level`, above them all."""
    assert not {name for name in imported(path) if name.startswith(("pipelines.families", "pipelines.tasks"))}
