"""The scheduler simulation (`bench.scheduler_sim`) on hand-built traces: it drives the real
`StepScheduler`, so a policy change shows in its figures."""

from __future__ import annotations

from bench.scheduler_sim import Device, Spec, simulate


def trace() -> list[Spec]:
    # A 32-step batch request, then a 4-step interactive one due in twice its alone time.
    return [
        Spec("batch", "batch", "", 10, 32, 0.0),
        Spec("interactive", "interactive", "", 0, 4, 1.5, deadline=1.5 + 2 * 4),
    ]


def test_priority_preempts_the_batch_request_and_fifo_runs_it_late() -> None:
    device = Device(base=1.0, per_row=0.0)  # one step a time unit
    priority = simulate(trace(), device, seats=1)
    fifo = simulate(trace(), device, seats=1, fifo=True)
    # Priority: it joins at the next boundary (2.0), pausing the batch, and steps 4 times.
    assert priority["interactive"] == 6.0 and priority["batch"] == 36.0
    # FIFO: it waits for the batch request's 32 steps.
    assert fifo["interactive"] == 36.0 and fifo["batch"] == 32.0


def test_admission_refuses_what_cannot_make_its_deadline() -> None:
    device = Device(base=1.0, per_row=0.0)
    # The batch request has stepped (the group times are learnt) when the interactive one
    # arrives; under FIFO it would wait 32 steps: refused (None), not run late.
    fifo = simulate(trace(), device, seats=1, fifo=True, admission=True)
    assert fifo["interactive"] is None and fifo["batch"] == 32.0
    assert simulate(trace(), device, seats=1, admission=True)["interactive"] == 6.0
