"""The step budget learnt from running out of memory (`engine.sched.step_budget`), and the step
scheduler keeping admission and step groups within it. Pure: no executor, no clock."""

from __future__ import annotations

from engine.outputs import StageFit
from engine.sched.step_budget import RAISE_AFTER_FITS, StepBudget
from engine.sched.step_scheduler import StepScheduler
from tests.engine.fakes import make_request


def test_a_stage_out_of_memory_lowers_the_budget_to_what_fitted_below_it() -> None:
    budget = StepBudget(512, raise_by=64)
    news = budget.learn([StageFit("step", 512, True), StageFit("step", 256, True), StageFit("step", 128)])
    assert news is not None and news[0] and budget.limit == 128
    # Nothing fitted below the failure: half of it.
    budget = StepBudget(512, raise_by=64)
    budget.learn([StageFit("step", 300, True), StageFit("step", 512, True), StageFit("step", 384)])
    assert budget.limit == 150
    budget.learn([StageFit("step", 192, True), StageFit("step", 64)])
    assert budget.limit == 64  # a lower limit wins over an earlier one


def test_a_learnt_budget_rises_one_request_after_full_steps_fit_until_configured() -> None:
    budget = StepBudget(256, raise_by=64)
    budget.learn([StageFit("step", 256, True), StageFit("step", 128)])
    assert budget.limit == 128
    # Steps with room for another request, and other stages, say nothing.
    assert budget.learn([StageFit("step", 64)] * 50 + [StageFit("finish", 128)] * 50) is None
    assert budget.learn([StageFit("step", 128)] * (RAISE_AFTER_FITS - 1)) is None
    news = budget.learn([StageFit("step", 128)])
    assert news == (False, "running requests may hold 192 step tokens again") and budget.limit == 192
    budget.learn([StageFit("step", 192)] * RAISE_AFTER_FITS)
    assert budget.limit == 256 and budget.learnt is None


def test_running_requests_over_a_learnt_budget_step_in_join_order_within_it() -> None:
    scheduler = StepScheduler(max_num_seqs=8, max_step_cost=4 * 64)
    for i in range(5):
        scheduler.add(make_request(f"r{i}", arrival=i), key=("k",), cost=64)
    plan = scheduler.schedule()
    assert plan is not None and plan.step == ("r0", "r1", "r2", "r3")
    scheduler.learn_memory([StageFit("step", 256, True), StageFit("step", 128)])
    assert scheduler.max_step_cost == 128
    plan = scheduler.schedule()
    assert plan is not None and plan.join == () and plan.step == ("r0", "r1")
    scheduler.finish(["r0", "r1"])
    plan = scheduler.schedule()
    assert plan is not None and plan.join == () and plan.step == ("r2", "r3")  # r4 waits
    scheduler.finish(["r2"])
    plan = scheduler.schedule()
    assert plan is not None and [r.request_id for r in plan.join] == ["r4"] and plan.step == ("r3", "r4")


def test_prepare_and_finish_out_of_memory_leave_the_budget_alone() -> None:
    # Default budget 8 requests of cost 64, 6 running, 2 joining: encoding the 2 joiners
    # ran out and each half fitted. The budget bounds every running request's step cost;
    # a prepare's group (2 joiners) is not in that unit, so it must not cut the budget to one.
    budget = StepBudget(8 * 64, raise_by=64)
    prepare = [StageFit("prepare", 128, True), StageFit("prepare", 64), StageFit("prepare", 64)]
    assert budget.learn(prepare) is None and budget.limit == 8 * 64
    # One request whose decode ran out (a single image: nothing to halve) learns nothing.
    assert budget.learn([StageFit("finish", 64, True)]) is None and budget.limit == 8 * 64
    # A step that ran out still lowers it.
    budget.learn([StageFit("finish", 64, True), StageFit("step", 512, True), StageFit("step", 256)])
    assert budget.limit == 256
