"""The project's imports read from its source (top-level, inside functions and under
`TYPE_CHECKING` alike), for the tests that hold its layering and forbid import circles."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("server", "engine", "pipelines", "bench")


def module_name(path: Path) -> str:
    """`engine/sched/scheduler.py` -> `engine.sched.scheduler`; a package's `__init__.py` is
    the package."""
    name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    return name.removesuffix(".__init__")


def imported_names(path: Path) -> set[str]:
    """Every dotted name `path` imports, relative imports resolved; `from a import b` gives
    both `a` and `a.b` (b may be a module)."""
    module = module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def project_modules(packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    return {module_name(p): p for package in packages for p in sorted((ROOT / package).rglob("*.py"))}


def import_graph(packages: tuple[str, ...] = PACKAGES) -> dict[str, set[str]]:
    """Module -> the project modules it imports (a name that is not a module counts as the
    module it is defined in)."""
    modules = project_modules(packages)
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        deps = set()
        for imported in imported_names(path):
            if imported.split(".")[0] not in packages:
                continue
            name = imported
            while name and name not in modules:
                name = name.rpartition(".")[0]
            # A package's own submodules are not its imports of itself.
            if name and name != module and not module.startswith(name + "."):
                deps.add(name)
        graph[module] = deps
    return graph


def circles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(frozenset(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found
