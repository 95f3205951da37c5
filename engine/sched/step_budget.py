"""Step-level batching's compute budget (`--max-step-tokens`), learnt down when a step runs
out of memory and raised again, slowly, while it fits.

Request mode learns an image cap per batch key (`Scheduler.learn_memory`). Step mode
already measures every request in one unit, its step cost (rows x latent tokens), so it
learns one number per worker: the most step cost a step held without running out. The
runner reports each stage it ran over a group (prepare, step, finish) as a `StageFit`; a
group that ran out of memory is retried in halves, so the halves that fitted say what the
device holds. Only steps teach the budget: it bounds the step cost of every running
request, and a step's group is those requests, while a prepare's group is only the
requests joining and a finish's only those ending (a fit of 2 joiners says nothing about 6
running). Their out-of-memory errors are handled where they happen, by retrying in halves
(and a decode by `pipelines.decode.HalvingDecode` inside the VAE); they leave the budget
alone. Admission and step groups then stay within the learnt budget
(`StepScheduler`), and after `RAISE_AFTER_FITS` full steps fit it rises by one default
request's cost, until it is back at the configured one.

Pure: no I/O, no clock, no torch.
"""

from __future__ import annotations

from engine.outputs import StageFit

# Full steps that must fit at a learnt budget before it rises (request mode's
# `RAISE_CAP_AFTER`): memory may have been short only for a while (another process,
# fragmentation).
RAISE_AFTER_FITS = 20


class StepBudget:
    """The step cost one worker's running requests may hold: `configured` (None: no bound)
    until a stage runs out of memory, then what fitted. `raise_by` is how much one rise adds
    (the engine: one default-size request's cost)."""

    def __init__(self, configured: int | None, raise_by: int) -> None:
        self.configured = configured
        self.raise_by = max(1, raise_by)
        self.learnt: int | None = None
        self._full_fits = 0

    @property
    def limit(self) -> int | None:
        return self.learnt if self.learnt is not None else self.configured

    def learn(self, fits: list[StageFit]) -> tuple[bool, str] | None:
        """Learn from the stages of one run: lower the budget if a step ran out of memory, count
        full steps that fitted under a learnt one. Returns (whether memory ran out, what
        changed), or None."""
        fitted = fitting_cost(fits)
        if fitted is not None:
            ran_out = max(fit.cost for fit in fits if fit.out_of_memory and fit.stage == "step")
            current = self.limit
            self.learnt = fitted if current is None else min(fitted, current)
            self._full_fits = 0
            return True, (
                f"out of memory with {ran_out} step tokens in one step; "
                f"running requests now hold {self.learnt} at most"
            )
        for fit in fits:
            if self.learnt is None or fit.stage != "step" or fit.out_of_memory:
                continue
            if fit.cost + self.raise_by <= self.learnt:
                continue  # room for another request: says nothing about the budget
            self._full_fits += 1
            if self._full_fits >= RAISE_AFTER_FITS:
                return False, self._rise()
        return None

    def _rise(self) -> str:
        assert self.learnt is not None
        self._full_fits = 0
        self.learnt += self.raise_by
        if self.configured is not None and self.learnt >= self.configured:
            self.learnt = None
            return f"running requests may hold {self.configured} step tokens again (as configured)"
        return f"running requests may hold {self.learnt} step tokens again"


def fitting_cost(fits: list[StageFit]) -> int | None:
    """After steps ran out of memory and were retried in halves: the most cost one step group
    held without running out (below its smallest failure), or half that failure. None if no
    step ran out (prepare and finish do not count: see the module's docstring)."""
    ran = [fit for fit in fits if fit.stage == "step"]
    failures = [fit.cost for fit in ran if fit.out_of_memory]
    if not failures:
        return None
    smallest = min(failures)
    fitted = [fit.cost for fit in ran if not fit.out_of_memory and fit.cost < smallest]
    return max(1, max(fitted, default=smallest // 2))
