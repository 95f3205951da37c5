"""Which step-mode requests' denoising state a worker process holds, as its `ProcessExecutor`
tracks it: to fail them all when the worker dies (their state died with it), and to tell
a worker that serves on to drop the states of requests that failed in the server."""

from __future__ import annotations

import dataclasses

from engine.outputs import BatchOutput
from engine.sched.step_plan import StepPlan


class HeldStates:
    def __init__(self) -> None:
        self._holding: set[str] = set()  # joined, not yet ended
        self._decoding: set[str] = set()  # done stepping, decoded beside the steps
        self._to_drop: set[str] = set()  # to drop with the next plan: they failed here

    def sent(self, plan: StepPlan) -> StepPlan:
        """`plan` as it goes to the worker: it also drops what the worker should forget."""
        if self._to_drop:
            plan = dataclasses.replace(plan, drop=(*plan.drop, *sorted(self._to_drop)))
            self._to_drop.clear()
        # Drop first, then join, as the worker does: an id both dropped and joined (retried
        # on this worker at once, or sent again by its client) is held in its new state.
        self._holding.difference_update(plan.drop)
        self._holding.update(r.request_id for r in plan.join)
        return plan

    def unsent(self, plan: StepPlan) -> None:
        """`plan` (as `sent` made it) never reached the worker: its joiners are not held, and
        what it dropped is still to drop."""
        self._holding.difference_update(r.request_id for r in plan.join)
        self._to_drop.update(plan.drop)

    def answered(self, output: BatchOutput) -> None:
        ended = [*output.outputs, *output.errors]
        self._holding.difference_update(ended)
        self._decoding.update(output.decoding)
        self._decoding.difference_update(ended)

    def died(self) -> set[str]:
        """The worker died: every request it held is lost, and the next one holds nothing."""
        lost = self._holding | self._decoding
        self._holding.clear()
        self._decoding.clear()
        self._to_drop.clear()
        return lost

    def faulted(self, request_ids: list[str]) -> list[str]:
        """A run of these requests went wrong, the worker serves on: they fail, with those
        decoded beside the run (their outputs may have been in what was lost), and the
        worker drops what it holds of them."""
        lost = [*request_ids, *(rid for rid in self._decoding if rid not in request_ids)]
        self.forget(lost)
        return lost

    def forget(self, request_ids: list[str]) -> None:
        self._to_drop.update(rid for rid in request_ids if rid in self._holding)
        self._holding.difference_update(request_ids)
        self._decoding.difference_update(request_ids)
