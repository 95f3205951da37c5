"""No import circles in the project, `TYPE_CHECKING` and function-level imports included: a
circle closed lazily is still two modules that cannot be read, tested or moved apart."""

from __future__ import annotations

from tests.imports import circles, import_graph


def test_the_project_has_no_import_circle() -> None:
    found = sorted(sorted(circle) for circle in circles(import_graph()))
    assert not found, f"import circles: {found}"


def test_a_circle_is_found_lazy_imports_included() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [frozenset({"a", "b", "c"})]
