"""`HeldStates`: which step-mode requests a worker process holds, as its executor tracks it."""

from __future__ import annotations

from engine.executor.held_states import HeldStates
from engine.outputs import BatchOutput
from engine.request import GenerationRequest, SamplingParams
from engine.sched.step_plan import StepPlan


def request(request_id: str) -> GenerationRequest:
    return GenerationRequest.create("p", SamplingParams(), request_id=request_id)


def test_requests_that_fail_in_the_server_are_dropped_by_the_worker_with_the_next_plan() -> None:
    held = HeldStates()
    held.sent(StepPlan(join=(request("a"), request("b"), request("c")), step=("a", "b", "c")))
    held.answered(BatchOutput(decoding=["c"]))  # c's decode runs beside the steps
    # The answer to a run of a and b cannot be read: they fail, and c (its output may
    # have been in it); the worker serves on and must forget what it holds of them.
    assert held.faulted(["a", "b"]) == ["a", "b", "c"]
    plan = held.sent(StepPlan(join=(request("d"),), step=("d",), drop=("x",)))
    assert plan.drop == ("x", "a", "b", "c") and plan.step == ("d",)
    assert held.sent(StepPlan(join=(), step=("d",))).drop == ()  # once
    assert held.died() == {"d"}  # a worker that dies takes what it held with it


def test_a_worker_that_died_leaves_nothing_to_drop() -> None:
    held = HeldStates()
    held.sent(StepPlan(join=(request("a"),), step=("a",)))
    held.faulted(["a"])
    assert held.died() == set()
    assert held.sent(StepPlan(join=(), step=())).drop == ()


def test_a_request_dropped_and_joined_again_in_one_plan_stays_held() -> None:
    """A request that faulted and is retried on the same worker at once (or an id a client
    sends again while its drop is pending): the worker drops the old state, then prepares
    the new one, so the executor must still count it as held."""
    held = HeldStates()
    held.sent(StepPlan(join=(request("x"),), step=("x",)))
    held.faulted(["x"])
    plan = held.sent(StepPlan(join=(request("x"),), step=()))
    assert plan.drop == ("x",) and [r.request_id for r in plan.join] == ["x"]
    assert held.died() == {"x"}  # main: set(), so a dead worker never failed it
