"""`choose_lane`: where a step-mode request goes when the engine has several workers."""

from __future__ import annotations

import threading
from typing import cast

import pytest

from engine.core.lanes import Lane, LaneLoad, choose_lane
from engine.executor.abstract import Executor
from engine.outputs import StageFit
from engine.sched.step_scheduler import StepScheduler

A, B = ("a",), ("b",)


def load(
    *keys: tuple[str, ...],
    cost: int = 0,
    requests: int | None = None,
    healthy: bool = True,
    budget: int | None = 8,
) -> LaneLoad:
    return LaneLoad(frozenset(keys), cost, len(keys) if requests is None else requests, healthy, budget)


def test_an_idle_lane_wins_over_company() -> None:
    assert choose_lane([load(A, cost=1), load()], A, 1) == 1


def test_the_first_idle_lane_when_all_are_idle() -> None:
    assert choose_lane([load(), load(), load()], A, 1) == 0


def test_a_key_joins_the_lane_that_holds_it_while_it_has_room() -> None:
    loads = [load(B, cost=1), load(A, cost=6, requests=6)]
    assert choose_lane(loads, A, 2) == 1  # 6 + 2 fits: it joins, though lane 0 is emptier


def test_a_full_lane_sends_its_key_to_the_least_loaded() -> None:
    loads = [load(B, cost=3, requests=3), load(A, cost=7, requests=7), load(B, cost=2, requests=2)]
    assert choose_lane(loads, A, 2) == 2


def test_the_least_loaded_of_several_lanes_holding_the_key() -> None:
    loads = [load(A, cost=5, requests=5), load(A, cost=2, requests=2)]
    assert choose_lane(loads, A, 1) == 1


def test_no_budget_means_always_room() -> None:
    assert choose_lane([load(B, cost=1), load(A, cost=10**9, budget=None)], A, 1) == 1


def test_a_lane_whose_worker_is_down_is_avoided() -> None:
    loads = [load(healthy=False), load(A, cost=8, requests=8)]
    assert choose_lane(loads, A, 1) == 1


def test_when_every_worker_is_down_requests_still_find_a_lane() -> None:
    loads = [load(A, cost=3, healthy=False), load(healthy=False)]
    assert choose_lane(loads, A, 1) == 1


def test_no_lanes_is_a_bug() -> None:
    with pytest.raises(ValueError):
        choose_lane([], A, 1)


def test_each_lane_is_held_to_its_own_learnt_budget() -> None:
    # Lane 1 ran out of memory and learnt 4; lane 0 is at the configured 8. A request of
    # cost 2 beside lane 1's 3 would exceed lane 1's budget: it goes to the least loaded.
    loads = [load(B, cost=1, requests=1), load(A, cost=3, requests=3, budget=4)]
    assert choose_lane(loads, A, 2) == 0
    loads = [load(A, cost=3, requests=3, budget=4), load(B, cost=1, requests=1)]
    assert choose_lane(loads, A, 1) == 0  # 3 + 1 fits lane 0's 4


class _UpExecutor:
    def health(self) -> str | None:
        return None


def test_a_lanes_load_carries_its_own_learnt_budget() -> None:
    steps = StepScheduler(max_num_seqs=8, max_step_cost=8 * 64)
    steps.learn_memory([StageFit("step", 512, True), StageFit("step", 256)])
    lane = Lane(0, cast(Executor, _UpExecutor()), threading.Event(), threading.Event(), steps=steps)
    assert lane.load().budget == 256
