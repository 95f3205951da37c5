"""The engine's running means, which the Retry-After estimate reads."""

from __future__ import annotations

import pytest

from engine.core.stats import EngineStats
from engine.outputs import BatchOutput, ForwardRecord


def test_a_request_level_forward_counts_as_its_steps() -> None:
    stats = EngineStats()
    stats.record_forwards([ForwardRecord(num_requests=4, num_images=4, seconds=8.0, ok=True, steps=4)])
    assert stats.mean_step_s == pytest.approx(2.0)
    assert stats.mean_step_requests == pytest.approx(4.0)


def test_a_step_level_forward_is_one_step_and_failures_do_not_count() -> None:
    stats = EngineStats()
    stats.record_forwards(
        [
            ForwardRecord(num_requests=2, num_images=2, seconds=0.5, ok=True),
            ForwardRecord(num_requests=8, num_images=8, seconds=9.0, ok=False, out_of_memory=True),
            ForwardRecord(num_requests=8, num_images=8, seconds=9.0, ok=True, interrupted=True),
        ]
    )
    assert stats.mean_step_s == pytest.approx(0.5)
    assert stats.mean_step_requests == pytest.approx(2.0)
    assert stats.num_forwards == 3


def test_a_step_that_shared_the_device_with_a_decode_is_not_a_steps_cost() -> None:
    stats = EngineStats()
    stats.record_forwards([ForwardRecord(2, 2, 1.0, ok=True)])
    stats.record_forwards([ForwardRecord(2, 2, 9.0, ok=True, shared=True)])
    assert stats.mean_step_s == 1.0 and stats.num_forwards == 2


def test_prompt_cache_counts_are_each_workers_latest_added_up() -> None:
    stats = EngineStats()
    assert stats.prompt_cache_totals() == {}
    stats.record_prompt_cache(0, BatchOutput(prompt_cache={"hits": 1.0, "bytes": 10.0}))
    stats.record_prompt_cache(0, BatchOutput(prompt_cache={"hits": 3.0, "bytes": 20.0}))  # cumulative
    stats.record_prompt_cache(1, BatchOutput(prompt_cache={"hits": 2.0, "bytes": 5.0}))
    stats.record_prompt_cache(1, BatchOutput())  # a result from a pipeline without one
    assert stats.prompt_cache_totals() == {"hits": 5.0, "bytes": 25.0}
