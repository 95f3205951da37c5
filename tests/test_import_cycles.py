"""No import circles in the project, `TYPE_CHECKING` and function-level imports included: a
circle closed lazily is still two modules that cannot be read, tested or moved apart."""

from __future__ import annotations

from tests.imports import circles, import_graph

# Circles known when this test was written, each to be broken by its owner and then
# removed from this list (the test fails too when a listed circle is gone, so the list only
# shrinks). engine/ has none and must keep it so.
KNOWN_CIRCLES = {
    # pipelines/: the stepping state holds the caches, which name it (and First-Block
    # Cache's row decisions name the cache) under TYPE_CHECKING.
    frozenset(
        {
            "pipelines.cache.first_block",
            "pipelines.cache.row_decisions",
            "pipelines.cache.taylor_seer",
            "pipelines.stepping.state",
        }
    ),
    # pipelines/: a family imports its tasks' base, which names `Family` under TYPE_CHECKING.
    frozenset({"pipelines.families.base", "pipelines.tasks.base"}),
    # pipelines/: the registry imports the generic adapter, which imports the registry in a function.
    frozenset({"pipelines.generic", "pipelines.registry"}),
}


def test_no_import_circles_but_the_known_ones() -> None:
    found = set(circles(import_graph()))
    new = [sorted(c) for c in found - KNOWN_CIRCLES]
    assert not new, f"import circles: {new}"
    assert not any(module.startswith("engine") for circle in found for module in circle)


def test_known_circles_still_exist() -> None:
    """A circle broken is taken off KNOWN_CIRCLES, so it cannot come back unnoticed."""
    gone = [sorted(c) for c in KNOWN_CIRCLES - set(circles(import_graph()))]
    assert not gone, f"no longer circles; remove them from KNOWN_CIRCLES: {gone}"


def test_a_circle_is_found_lazy_imports_included() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [frozenset({"a", "b", "c"})]
