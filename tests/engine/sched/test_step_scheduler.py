"""Step scheduler policy, with requests built by hand: no event loop, no torch."""

from __future__ import annotations

from dataclasses import replace

import pytest

from engine.errors import DuplicateRequestError
from engine.outputs import StageFit
from engine.request import GenerationRequest, LoraRef
from engine.sched.step_scheduler import StepScheduler
from tests.engine.fakes import make_request


def add(scheduler: StepScheduler, *requests: GenerationRequest, key: object = "a") -> None:
    for request in requests:
        scheduler.add(request, (key,))


def test_requests_with_different_steps_and_guidance_step_together() -> None:
    scheduler = StepScheduler(max_num_seqs=8)
    add(scheduler, make_request("r0", steps=4, guidance=1.0), make_request("r1", steps=32, guidance=7.5))
    plan = scheduler.schedule()
    assert plan is not None
    assert [r.request_id for r in plan.join] == ["r0", "r1"]
    assert plan.step == ("r0", "r1")
    assert scheduler.num_waiting == 0 and scheduler.num_running == 2


def test_newcomers_join_the_running_group_at_the_next_step() -> None:
    scheduler = StepScheduler(max_num_seqs=8)
    add(scheduler, make_request("old"))
    scheduler.schedule()
    add(scheduler, make_request("new"))
    plan = scheduler.schedule()
    assert plan is not None
    assert [r.request_id for r in plan.join] == ["new"]
    assert plan.step == ("old", "new")


def test_admission_is_in_order_and_bounded_by_images() -> None:
    scheduler = StepScheduler(max_num_seqs=4)
    add(scheduler, make_request("a", n=2), make_request("b", n=3), make_request("c", n=1))
    plan = scheduler.schedule()
    assert plan is not None
    # b does not fit beside a; c would, but it may not pass b (b would starve).
    assert [r.request_id for r in plan.join] == ["a"]
    assert scheduler.finish(["a"]) == ["a"]
    plan = scheduler.schedule()
    assert plan is not None and [r.request_id for r in plan.join] == ["b", "c"]


def test_a_request_larger_than_the_budget_runs_alone() -> None:
    scheduler = StepScheduler(max_num_seqs=2)
    add(scheduler, make_request("big", n=5), make_request("small"))
    plan = scheduler.schedule()
    assert plan is not None and plan.step == ("big",)
    scheduler.finish(["big"])
    plan = scheduler.schedule()
    assert plan is not None and plan.step == ("small",)


def test_admission_is_bounded_by_compute_so_one_large_request_is_not_one_of_eight() -> None:
    """Costs are rows x latent tokens: a 1024x1024 image weighs 16 times a 256x256 one."""
    scheduler = StepScheduler(max_num_seqs=8, max_step_cost=8 * 1024)
    for i in range(3):
        scheduler.add(make_request(f"small{i}"), ("small",), cost=1024)
    scheduler.add(make_request("large"), ("large",), cost=16 * 1024)
    scheduler.add(make_request("after"), ("small",), cost=1024)
    plan = scheduler.schedule()
    # The large one does not fit beside the small ones, and nothing passes it.
    assert plan is not None and [r.request_id for r in plan.join] == ["small0", "small1", "small2"]
    assert scheduler.running_cost == 3 * 1024
    scheduler.finish(["small0", "small1", "small2"])
    plan = scheduler.schedule()
    # Alone it runs although it exceeds the budget, and takes all of it.
    assert plan is not None and [r.request_id for r in plan.join] == ["large"]
    assert scheduler.schedule() == plan.__class__(join=(), step=("large",), key=("large",))
    scheduler.finish(["large"])
    plan = scheduler.schedule()
    assert plan is not None and [r.request_id for r in plan.join] == ["after"]


def test_rows_of_mixed_sizes_count_their_padded_tokens_against_the_budget() -> None:
    """One step key for every size (a family that pads rows to one grid): a group costs its
    rows x the padded grid, so 4x4, 6x6 and 8x8 grids of 16, 36 and 64 tokens cost 3 x 64
    (192), not their sum (116); the third waits while two of them fill a budget of 150."""
    scheduler = StepScheduler(max_num_seqs=8, max_step_cost=150)
    for name, side in (("small", 4), ("middle", 6), ("large", 8)):
        scheduler.add(make_request(name), ("any size",), cost=side * side, grid=(side, side))
    plan = scheduler.schedule()
    # small + middle: 2 x 36 = 72; with large 3 x 64 = 192 > 150.
    assert plan is not None and plan.step == ("small", "middle")
    assert [r.request_id for r in plan.join] == ["small", "middle"]
    scheduler.finish(["small"])
    plan = scheduler.schedule()
    assert plan is not None and plan.step == ("middle", "large")  # 2 x 64 = 128


def test_packed_rows_cost_their_own_tokens_until_a_padded_one_joins_them() -> None:
    """Rows packed end to end (`packs`) cost their own tokens: 16 + 36 + 64 = 116 fits a
    budget of 150 with all three. A request of the same key that does not pack (a cached one)
    makes its forward pad every row: with it, the group counts the padded grid again."""
    scheduler = StepScheduler(max_num_seqs=8, max_step_cost=150)
    for name, side in (("small", 4), ("middle", 6), ("large", 8)):
        scheduler.add(make_request(name), ("any size",), cost=side * side, grid=(side, side), packs=True)
    plan = scheduler.schedule()
    assert plan is not None and plan.step == ("small", "middle", "large")
    assert scheduler.running_cost == 116
    scheduler.add(make_request("cached"), ("any size",), cost=16, grid=(4, 4), packs=False)
    assert scheduler.held_cost == 4 * 64  # all four padded to 8x8
    scheduler.finish(["small", "middle", "large"])
    plan = scheduler.schedule()
    assert plan is not None and plan.step == ("cached",)


def test_held_and_running_costs_count_padded_tokens_as_the_budget_does() -> None:
    """Lane routing weighs a lane's held cost against its step budget: in the same units,
    one key's rows of 16, 36 and 64 tokens cost 3 x 64 (192), not 116; another key's rows
    are not padded with them."""
    scheduler = StepScheduler(max_num_seqs=8, max_step_cost=1000)
    for name, side in (("small", 4), ("middle", 6), ("large", 8)):
        scheduler.add(make_request(name), ("any size",), cost=side * side, grid=(side, side))
    scheduler.add(make_request("other"), ("sd", 32, 32), cost=10)
    assert scheduler.held_cost == 192 + 10
    assert scheduler.schedule() is not None
    assert scheduler.running_cost == 192 + 10


def test_a_group_cut_to_a_learnt_budget_counts_padded_tokens() -> None:
    scheduler = StepScheduler(max_num_seqs=8, max_step_cost=1000)
    for name, side in (("small", 4), ("large", 8)):
        scheduler.add(make_request(name), ("any size",), cost=side * side, grid=(side, side))
    assert scheduler.schedule() is not None
    # A step of both (2 x 64 = 128 padded) ran out of memory; one of 100 had fitted.
    scheduler.learn_memory(
        [StageFit("step", 100, out_of_memory=False), StageFit("step", 128, out_of_memory=True)]
    )
    plan = scheduler.schedule()
    assert plan is not None and plan.step == ("small",)  # 16 + 64 = 80 unpadded would fit


def test_a_budget_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="max_step_cost"):
        StepScheduler(max_num_seqs=8, max_step_cost=0)


def test_the_oldest_running_request_chooses_the_key_and_nothing_starves() -> None:
    scheduler = StepScheduler(max_num_seqs=8)
    add(scheduler, make_request("a0"), key="a")
    add(scheduler, make_request("b0"), key="b")
    add(scheduler, make_request("a1"), key="a")
    plan = scheduler.schedule()
    assert plan is not None and plan.step == ("a0", "a1") and plan.key == ("a",)
    scheduler.finish(["a0"])
    add(scheduler, make_request("a2"), key="a")  # younger than b0
    plan = scheduler.schedule()
    assert plan is not None and plan.step == ("b0",)


def test_an_aborted_waiting_request_never_runs() -> None:
    scheduler = StepScheduler(max_num_seqs=8)
    add(scheduler, make_request("a"), make_request("b"))
    assert scheduler.abort("a") is True
    plan = scheduler.schedule()
    assert plan is not None and plan.step == ("b",) and plan.drop == ()


def test_an_aborted_running_request_leaves_at_the_next_step_and_its_state_is_dropped() -> None:
    scheduler = StepScheduler(max_num_seqs=8)
    add(scheduler, make_request("a"), make_request("b"))
    scheduler.schedule()
    assert scheduler.abort("a") is False
    plan = scheduler.schedule()
    assert plan is not None and plan.step == ("b",) and plan.drop == ("a",)
    # Its result, if the executor reports one anyway, is owed to nobody.
    assert scheduler.finish(["a", "b"]) == ["b"]


def test_a_drop_is_sent_even_when_nothing_else_runs() -> None:
    scheduler = StepScheduler(max_num_seqs=8)
    add(scheduler, make_request("a"))
    scheduler.schedule()
    scheduler.abort("a")
    assert scheduler.has_work()
    plan = scheduler.schedule()
    assert plan is not None and plan.step == () and plan.drop == ("a",)
    assert not scheduler.has_work() and scheduler.schedule() is None


def test_duplicate_ids_are_refused() -> None:
    scheduler = StepScheduler(max_num_seqs=8)
    add(scheduler, make_request("a"))
    with pytest.raises(DuplicateRequestError):
        add(scheduler, make_request("a"))
    with pytest.raises(ValueError, match="max_num_seqs"):
        StepScheduler(max_num_seqs=0)


def test_a_request_decoding_beside_the_steps_gives_up_its_share_but_stays_owed() -> None:
    scheduler = StepScheduler(max_num_seqs=2)
    add(scheduler, make_request("done"), make_request("other"), make_request("next"))
    first = scheduler.schedule()
    assert first is not None and first.step == ("done", "other")  # "next" waits: 2 images max
    scheduler.release(["done"])
    plan = scheduler.schedule()
    assert plan is not None and [r.request_id for r in plan.join] == ["next"]
    assert plan.step == ("other", "next") and scheduler.num_decoding == 1
    assert scheduler.has_request("done")
    assert scheduler.finish(["done"]) == ["done"]  # its images: owed, delivered once
    assert scheduler.finish(["done"]) == [] and not scheduler.has_request("done")


def test_with_only_decodes_left_the_plan_steps_nothing_and_an_abort_forgets_the_decode() -> None:
    scheduler = StepScheduler(max_num_seqs=8)
    add(scheduler, make_request("a"), make_request("b"))
    scheduler.schedule()
    scheduler.release(["a", "b"])
    plan = scheduler.schedule()
    assert plan is not None and plan.step == () and plan.join == ()  # the executor hands decodes over
    assert scheduler.abort("a") is False  # it was not waiting
    assert scheduler.finish(["a", "b"]) == ["b"]  # a's late images are not owed
    assert not scheduler.has_work() and scheduler.schedule() is None


def with_lora(request: GenerationRequest, name: str | None) -> GenerationRequest:
    return request.with_params(replace(request.params, lora=None if name is None else LoraRef(name)))


def test_no_more_adapters_run_at_once_than_the_model_holds() -> None:
    """A joiner with a third adapter waits (in order: nobody passes it) while two run, so
    preparing it never unloads an adapter a running group needs; the base model takes no
    adapter slot."""
    scheduler = StepScheduler(max_num_seqs=8, max_adapters=2)
    adapters = ["a", "b", None, "a", "c", "b"]
    for i, name in enumerate(adapters):
        scheduler.add(with_lora(make_request(f"r{i}"), name), (name,))
    plan = scheduler.schedule()
    assert plan is not None and [r.request_id for r in plan.join] == ["r0", "r1", "r2", "r3"]
    scheduler.finish(["r0", "r3"])  # adapter a leaves: room for c
    plan = scheduler.schedule()
    assert plan is not None and [r.request_id for r in plan.join] == ["r4", "r5"]


def test_can_admit_says_whether_the_next_plan_would_take_the_head_of_the_queue() -> None:
    """The engine interrupts running steps for an arrival only when it could join: a full
    group (images, compute or adapters) makes arrivals wait for a running request to end."""
    scheduler = StepScheduler(max_num_seqs=2, max_step_cost=10, max_adapters=1)
    assert not scheduler.can_admit()  # nothing waits
    scheduler.add(make_request("a"), ("k",), cost=4)
    assert scheduler.can_admit()  # nothing runs: anything goes
    scheduler.schedule()
    scheduler.add(make_request("b"), ("k",), cost=4)
    assert scheduler.can_admit()
    scheduler.schedule()
    scheduler.add(make_request("c"), ("k",), cost=1)
    assert not scheduler.can_admit()  # two images run, the most there may be
    scheduler.finish(["a"])
    assert scheduler.can_admit()
    scheduler.schedule()
    scheduler.add(make_request("d"), ("k",), cost=6)
    assert not scheduler.can_admit()  # b and c hold 5 of 10: d's 6 is too much
    assert scheduler.abort("d")
    scheduler.finish(["b", "c"])
    scheduler.add(with_lora(make_request("e"), "x"), ("x",), cost=1)
    scheduler.schedule()
    scheduler.add(with_lora(make_request("f"), "y"), ("y",), cost=1)
    assert not scheduler.can_admit()  # a second adapter, one allowed
    scheduler.add(with_lora(make_request("g"), "x"), ("x",), cost=1)
    assert not scheduler.can_admit()  # g would fit, but it may not pass f
    assert scheduler.abort("f")
    assert scheduler.can_admit()
