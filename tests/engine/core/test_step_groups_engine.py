"""Admission by deadline with deadline-aware step groups (`engine.sched.step_groups`), through the
engine with a fake stepping pipeline in a real executor thread; the step time is taught by
hand, so nothing depends on how fast this machine runs the fakes."""

from __future__ import annotations

from dataclasses import replace

import pytest

from engine.core.config import EngineConfig
from engine.core.engine import AsyncEngine
from engine.errors import DeadlineUnmeetableError
from engine.executor.thread_executor import ThreadExecutor
from engine.outputs import ForwardRecord
from engine.request import GenerationRequest
from tests.engine.core.test_deadline_engine import due_in, pipeline_for
from tests.engine.core.test_priority_engine import release
from tests.engine.fakes import make_request
from tests.polling import until


def with_priority(request: GenerationRequest, priority: int) -> GenerationRequest:
    return replace(request, params=replace(request.params, priority=priority))


@pytest.mark.parametrize("groups", [True, False])
async def test_running_work_a_newcomer_outranks_is_not_ahead_of_it_with_deadline_groups(groups: bool) -> None:
    pipeline = pipeline_for("step")
    config = EngineConfig(8, batching="step", deadline_groups=groups)
    engine = AsyncEngine(ThreadExecutor(lambda: pipeline), config)
    await engine.start()
    handles = []
    try:
        handles.append(engine.submit(with_priority(make_request("batch", steps=50), 10)))
        await until(lambda: engine.num_waiting == 0, "the batch request runs")
        work = engine._work.left("batch")
        assert work is not None
        record = ForwardRecord(num_requests=1, num_images=1, seconds=0.0, ok=True)
        for _ in range(2):  # the warm-up (a first request done), then a unit measured
            engine._work.rates.learn(work.key, [record], work.cost, seconds=2.0, finished=True)
        # The batch request runs; the urgent one needs one step of 2 s of its own (x HEADROOM)
        # of its 3.5 s, but a step beside the batch row, of twice the cost, takes 4 s.
        urgent = with_priority(due_in("urgent", 3.5), 0)
        if groups:  # the batch rows step beside it only while it is on track
            handles.append(engine.submit(urgent))
        else:
            with pytest.raises(DeadlineUnmeetableError):
                engine.submit(urgent)
        # Equal priority: the running row steps beside it either way.
        with pytest.raises(DeadlineUnmeetableError):
            engine.submit(with_priority(due_in("peer", 3.5), 10))
    finally:
        release(pipeline)
        for handle in handles:
            await handle.result()
        await engine.stop()
