"""`Residency`: which idle models leave so another fits, least recently used first."""

from __future__ import annotations

from engine.models.residency import Residency


def loaded(budget: int | None, **models: tuple[int, float]) -> Residency:
    residency = Residency(budget)
    for name, (footprint, used) in models.items():
        residency.add(name, footprint, used)
    return residency


def test_no_budget_never_evicts() -> None:
    residency = loaded(None, a=(10**12, 0.0))
    assert residency.evictions("b", busy=set()) == []


def test_unknown_size_loads_then_trims_the_least_recently_used_idle() -> None:
    residency = loaded(100, a=(40, 1.0), b=(40, 2.0))
    assert residency.evictions("c", busy=set()) == []  # size unknown until it loads
    residency.add("c", 40, 3.0)
    assert residency.over_budget(busy=set(), keep="c") == ["a"]


def test_known_size_makes_room_first_oldest_idle_first() -> None:
    residency = loaded(100, a=(40, 1.0), b=(40, 2.0))
    residency.known["c"] = 50
    assert residency.evictions("c", busy=set()) == ["a"]
    residency.known["c"] = 90
    assert residency.evictions("c", busy=set()) == ["a", "b"]


def test_busy_models_are_never_chosen() -> None:
    residency = loaded(100, a=(40, 1.0), b=(40, 2.0))
    residency.known["c"] = 50
    assert residency.evictions("c", busy={"a"}) == ["b"]
    assert residency.evictions("c", busy={"a", "b"}) is None  # wait until one is idle


def test_touch_changes_the_order() -> None:
    residency = loaded(100, a=(40, 1.0), b=(40, 2.0))
    residency.touch("a", 3.0)
    residency.known["c"] = 50
    assert residency.evictions("c", busy=set()) == ["b"]


def test_a_loaded_model_needs_no_room_and_trim_keeps_the_new_one() -> None:
    residency = loaded(50, a=(40, 1.0))
    assert residency.evictions("a", busy=set()) == []
    residency.add("b", 40, 2.0)
    assert residency.over_budget(busy={"a"}, keep="b") is None  # both stay until a goes idle
    residency.remove("a")
    assert residency.used == 40
