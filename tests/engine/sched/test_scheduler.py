"""Scheduler policy, with requests built by hand: no event loop, no torch."""

from __future__ import annotations

import pytest

from engine.errors import DuplicateRequestError
from engine.request import GenerationRequest
from engine.sched.scheduler import RAISE_CAP_AFTER, Scheduler
from tests.engine.fakes import make_request


def key_of(request: GenerationRequest) -> tuple[object, ...]:
    p = request.params
    return (p.width, p.height, p.num_inference_steps, p.guidance_scale)


def add_all(scheduler: Scheduler, *requests: GenerationRequest) -> None:
    for request in requests:
        scheduler.add(request, key_of(request))


def test_compatible_requests_share_one_batch_in_arrival_order() -> None:
    scheduler = Scheduler(max_num_seqs=8)
    add_all(scheduler, *(make_request(f"r{i}", arrival=i, prompt=f"p{i}") for i in range(5)))
    batch = scheduler.next_batch()
    assert batch is not None
    assert batch.request_ids == ["r0", "r1", "r2", "r3", "r4"]
    assert scheduler.num_waiting == 0 and scheduler.num_running == 5


@pytest.mark.parametrize(
    "other",
    [
        {"size": 128},
        {"steps": 8},
        {"guidance": 3.0},
    ],
)
def test_incompatible_parameters_never_share_a_batch(other: dict[str, object]) -> None:
    scheduler = Scheduler(max_num_seqs=8)
    add_all(scheduler, make_request("a", arrival=0), make_request("b", arrival=1, **other))  # type: ignore[arg-type]
    first, second = scheduler.next_batch(), scheduler.next_batch()
    assert first is not None and second is not None
    assert first.request_ids == ["a"] and second.request_ids == ["b"]


def test_lora_is_part_of_what_keys_compare() -> None:
    scheduler = Scheduler(max_num_seqs=8)
    scheduler.add(make_request("a"), ("k", None))
    scheduler.add(make_request("b"), ("k", ("style", 1.0)))
    scheduler.add(make_request("c"), ("k", ("style", 0.5)))
    sizes = [len(b) for b in iter(scheduler.next_batch, None)]
    assert sizes == [1, 1, 1]


def test_incompatible_head_does_not_block_compatible_requests_behind_it() -> None:
    scheduler = Scheduler(max_num_seqs=8)
    add_all(
        scheduler,
        make_request("big", arrival=0, size=128),
        make_request("s1", arrival=1),
        make_request("s2", arrival=2),
    )
    first = scheduler.next_batch()
    second = scheduler.next_batch()
    assert first is not None and first.request_ids == ["big"]
    assert second is not None and second.request_ids == ["s1", "s2"]


def test_oldest_request_always_goes_next_so_nothing_starves() -> None:
    scheduler = Scheduler(max_num_seqs=2)
    add_all(scheduler, make_request("old", arrival=0, size=128))
    # A steady stream of compatible small requests keeps arriving...
    for i in range(6):
        add_all(scheduler, make_request(f"s{i}", arrival=1 + i))
    batch = scheduler.next_batch()
    assert batch is not None and batch.request_ids == ["old"]


def test_max_num_seqs_counts_images_not_requests() -> None:
    scheduler = Scheduler(max_num_seqs=4)
    add_all(
        scheduler,
        make_request("a", arrival=0, n=3),
        make_request("b", arrival=1, n=2),  # would make 5 images: waits
        make_request("c", arrival=2, n=1),  # fits
    )
    first = scheduler.next_batch()
    assert first is not None and first.request_ids == ["a", "c"] and first.num_images == 4
    second = scheduler.next_batch()
    assert second is not None and second.request_ids == ["b"]


def test_a_request_larger_than_max_num_seqs_still_runs_alone() -> None:
    scheduler = Scheduler(max_num_seqs=2)
    add_all(scheduler, make_request("huge", arrival=0, n=5), make_request("b", arrival=1))
    first = scheduler.next_batch()
    assert first is not None and first.request_ids == ["huge"]


def test_max_batch_requests_one_gives_one_request_per_batch() -> None:
    scheduler = Scheduler(max_num_seqs=8, max_batch_requests=1)
    add_all(scheduler, *(make_request(f"r{i}", arrival=i) for i in range(3)))
    assert [b.request_ids for b in iter(scheduler.next_batch, None)] == [["r0"], ["r1"], ["r2"]]


def test_abort_of_a_waiting_request_removes_it() -> None:
    scheduler = Scheduler(max_num_seqs=8)
    add_all(scheduler, make_request("a", arrival=0), make_request("b", arrival=1))
    assert scheduler.abort("a") is True
    batch = scheduler.next_batch()
    assert batch is not None and batch.request_ids == ["b"]
    assert scheduler.abort("missing") is False


def test_abort_of_a_running_request_drops_it_from_finish() -> None:
    scheduler = Scheduler(max_num_seqs=8)
    add_all(scheduler, make_request("a", arrival=0), make_request("b", arrival=1))
    batch = scheduler.next_batch()
    assert batch is not None
    assert scheduler.abort("a") is False
    assert scheduler.finish(batch) == ["b"]
    assert scheduler.num_running == 0


def test_duplicate_request_id_is_rejected_while_held() -> None:
    scheduler = Scheduler(max_num_seqs=8)
    add_all(scheduler, make_request("a"))
    with pytest.raises(DuplicateRequestError):
        add_all(scheduler, make_request("a"))
    batch = scheduler.next_batch()
    assert batch is not None
    with pytest.raises(DuplicateRequestError):  # running counts too
        add_all(scheduler, make_request("a"))
    scheduler.finish(batch)
    add_all(scheduler, make_request("a"))  # finished ids may be reused


def test_head_batch_full_and_arrivals() -> None:
    scheduler = Scheduler(max_num_seqs=2)
    assert scheduler.head_batch_is_full() is False and scheduler.head_arrival() is None
    add_all(scheduler, make_request("a", arrival=1.0), make_request("x", arrival=2.0, size=128))
    assert scheduler.head_batch_is_full() is False
    assert scheduler.head_arrival() == 1.0
    assert scheduler.head_last_arrival() == 1.0  # the incompatible arrival does not count
    add_all(scheduler, make_request("b", arrival=3.0))
    assert scheduler.head_batch_is_full() is True
    assert scheduler.head_last_arrival() == 3.0


def test_invalid_limits_are_rejected() -> None:
    with pytest.raises(ValueError, match="max_num_seqs"):
        Scheduler(max_num_seqs=0)


def test_a_learnt_cap_bounds_batches_of_its_key_only() -> None:
    scheduler = Scheduler(max_num_seqs=8)
    small, large = make_request("s0", size=64), make_request("l0", size=128)
    assert scheduler.cap_images(key_of(large), 3) == 3
    assert scheduler.cap_images(key_of(large), 5) == 3  # a lower cap is never raised
    add_all(scheduler, *(make_request(f"l{i}", arrival=i, size=128) for i in range(5)))
    add_all(scheduler, *(make_request(f"s{i}", arrival=10 + i, size=64) for i in range(5)))
    first = scheduler.next_batch()
    assert first is not None and first.request_ids == ["l0", "l1", "l2"]
    assert not scheduler.head_batch_is_full()  # l3 and l4: 2 images, under the cap of 3
    second = scheduler.next_batch()
    assert second is not None and second.request_ids == ["l3", "l4"]
    third = scheduler.next_batch()
    assert third is not None and third.request_ids == [f"s{i}" for i in range(5)]
    assert key_of(small) != key_of(large)


def test_a_learnt_cap_rises_slowly_after_successes_and_then_goes() -> None:
    scheduler = Scheduler(max_num_seqs=4)
    key = ("k",)
    scheduler.cap_images(key, 2)
    assert scheduler.record_success(key, 1) is None  # under the cap: says nothing
    for _ in range(RAISE_CAP_AFTER - 1):
        assert scheduler.record_success(key, 2) is None
    assert scheduler.record_success(key, 2) == 3 and scheduler.image_limit(key) == 3
    for _ in range(RAISE_CAP_AFTER - 1):
        scheduler.record_success(key, 3)
    assert scheduler.record_success(key, 3) == 4 and scheduler.image_caps == {}
