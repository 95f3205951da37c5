"""`LaneGroupExecutor`: one lane of several devices (`--cfg-parallel 2`, `--sequence-parallel
N`, or 2 x N), its members the worker processes of `ProcessExecutor`s, one per device, forming
one `torch.distributed` group (the pipeline side: `pipelines.parallel`).

Every member gets every plan and holds the same states; each runs its share of each step's
forward (its share of the guided rows, its share of the tokens) and they exchange what the
others need, so all take the same step (`pipelines.parallel.lane_split`).
Members step once per plan (`WorkerOptions.step_once`): a runner that kept stepping on its
own would stop at its own time, and the members must take the same steps. Only the lead
(member 0) decodes and reports progress and previews; its answer is the lane's, with any
request another member failed failed too (and dropped wherever it is still held).

Faults: the members live and die together. When one dies (killed, a segfault, or a member
that found the group broken and left, `pipelines.parallel.lane_split`), the others are
killed at once, so none waits on a collective, and each supervisor restarts its own after
the back-off, where they meet again as a new group: the runs in flight fail with
`WorkerCrashedError` (503) for every request the lane held, as a worker's death does in a
one-device lane. Shared memory, restarts and shutdown are each member's, as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading

from engine.errors import ForwardError
from engine.executor.abstract import Loaded
from engine.executor.process_executor import ProcessExecutor
from engine.executor.worker_process import WorkerStats
from engine.outputs import BatchOutput
from engine.request import RequestBatch
from engine.sched.step_plan import StepPlan
from engine.worker.pipeline import ProgressListener
from engine.worker.stepping import Flag, PartialListener

logger = logging.getLogger(__name__)


class LaneGroupExecutor:
    """Runs each plan on every member; member 0 leads."""

    def __init__(self, members: list[ProcessExecutor]) -> None:
        if len(members) < 2:
            raise ValueError("a lane of several devices has at least two members")
        self._members = members
        # Members killed because another died: their own death is expected, not news.
        self._restarting: set[int] = set()
        for index, member in enumerate(members):
            member.watch_death(functools.partial(self._member_died, index))

    @property
    def stats(self) -> WorkerStats:
        """The members' counts added up; alive while every member is."""
        each = [member.stats for member in self._members]
        return WorkerStats(
            restarts=sum(s.restarts for s in each),
            crashes=sum(s.crashes for s in each),
            alive=all(s.alive for s in each),
            down_reason=self.health(),
            segments_received=sum(s.segments_received for s in each),
            pid=each[0].pid,
            started_at=max(s.started_at for s in each),
        )

    def new_flag(self) -> Flag:
        # Members step once per plan and run no request-level forward: no flag reaches them.
        return threading.Event()

    def health(self) -> str | None:
        for index, member in enumerate(self._members):
            reason = member.health()
            if reason is not None:
                return f"member {index} of the lane: {reason}"
        return None

    async def start(
        self, on_progress: ProgressListener | None = None, on_partial: PartialListener | None = None
    ) -> Loaded:
        """Start every member at once (they meet while loading); if one cannot start, stop
        the others rather than leave them waiting for it."""
        starts = [asyncio.ensure_future(self._members[0].start(on_progress, on_partial))]
        starts += [asyncio.ensure_future(member.start()) for member in self._members[1:]]
        _, pending = await asyncio.wait(starts, return_when=asyncio.FIRST_EXCEPTION)
        failed = next((task.exception() for task in starts if task.done() and task.exception()), None)
        if failed is None:
            return starts[0].result()
        await self.shutdown()
        for task in pending:  # their loading workers were killed: they end at once
            with contextlib.suppress(Exception):
                await task
        raise failed

    async def execute_batch(self, batch: RequestBatch, interrupt: Flag | None = None) -> BatchOutput:
        # Refused at start (`--batching request`); an engine that asks anyway gets an answer.
        error = ForwardError("a lane of several devices runs step by step only")
        return BatchOutput(errors=dict.fromkeys(batch.request_ids, error))

    async def execute_step(self, plan: StepPlan, attention: Flag | None = None) -> BatchOutput:
        outputs = await asyncio.gather(*(member.execute_step(plan) for member in self._members))
        return self._joined(list(outputs))

    async def shutdown(self) -> None:
        await asyncio.gather(*(member.shutdown() for member in self._members))

    def _joined(self, outputs: list[BatchOutput]) -> BatchOutput:
        """The lead's answer, failing what any member failed; a request that ended on some
        members only is dropped by the others with their next plan."""
        lead = outputs[0]
        for output in outputs[1:]:
            for request_id, error in output.errors.items():
                lead.errors.setdefault(request_id, error)
        for request_id in lead.errors:
            lead.outputs.pop(request_id, None)
        ended = {*lead.outputs, *lead.errors}
        for member, output in zip(self._members, outputs, strict=True):
            held = [rid for rid in ended if rid not in output.outputs and rid not in output.errors]
            if held:
                member.forget(held)
        return lead

    def _member_died(self, index: int) -> None:
        """On the event loop: member `index` died; unless the lane killed it, kill the others
        (their group is broken), so the whole lane restarts together."""
        if index in self._restarting:
            self._restarting.discard(index)
            return
        reason = f"member {index} of its lane died, and the lane restarts together"
        for other, member in enumerate(self._members):
            if other != index and member.restart_worker(reason):
                self._restarting.add(other)
