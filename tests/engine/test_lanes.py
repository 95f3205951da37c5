"""`choose_lane`: where a step-mode request goes when the engine has several workers."""

from __future__ import annotations

import pytest

from engine.lanes import LaneLoad, choose_lane

A, B = ("a",), ("b",)


def load(
    *keys: tuple[str, ...], cost: int = 0, requests: int | None = None, healthy: bool = True
) -> LaneLoad:
    return LaneLoad(frozenset(keys), cost, len(keys) if requests is None else requests, healthy)


def test_an_idle_lane_wins_over_company() -> None:
    assert choose_lane([load(A, cost=1), load()], A, 1, budget=8) == 1


def test_the_first_idle_lane_when_all_are_idle() -> None:
    assert choose_lane([load(), load(), load()], A, 1, budget=8) == 0


def test_a_key_joins_the_lane_that_holds_it_while_it_has_room() -> None:
    loads = [load(B, cost=1), load(A, cost=6, requests=6)]
    assert choose_lane(loads, A, 2, budget=8) == 1  # 6 + 2 fits: it joins, though lane 0 is emptier


def test_a_full_lane_sends_its_key_to_the_least_loaded() -> None:
    loads = [load(B, cost=3, requests=3), load(A, cost=7, requests=7), load(B, cost=2, requests=2)]
    assert choose_lane(loads, A, 2, budget=8) == 2


def test_the_least_loaded_of_several_lanes_holding_the_key() -> None:
    loads = [load(A, cost=5, requests=5), load(A, cost=2, requests=2)]
    assert choose_lane(loads, A, 1, budget=8) == 1


def test_no_budget_means_always_room() -> None:
    assert choose_lane([load(B, cost=1), load(A, cost=10**9)], A, 1, budget=None) == 1


def test_a_lane_whose_worker_is_down_is_avoided() -> None:
    loads = [load(healthy=False), load(A, cost=8, requests=8)]
    assert choose_lane(loads, A, 1, budget=8) == 1


def test_when_every_worker_is_down_requests_still_find_a_lane() -> None:
    loads = [load(A, cost=3, healthy=False), load(healthy=False)]
    assert choose_lane(loads, A, 1, budget=8) == 1


def test_no_lanes_is_a_bug() -> None:
    with pytest.raises(ValueError):
        choose_lane([], A, 1, budget=8)
