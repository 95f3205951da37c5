"""`Timelines`: each held request's `RequestTimeline` (`engine.timeline`), filled in from the
work the lane loops schedule and the records the executor sends back, and handed to the
engine's observers when the request ends (a tracing observer turns it into spans)."""

from __future__ import annotations

from engine.outputs import BatchOutput, ForwardRecord
from engine.request import RequestBatch
from engine.sched.step_plan import StepPlan
from engine.timeline import Interval, RequestTimeline


class Timelines:
    def __init__(self) -> None:
        self._held: dict[str, RequestTimeline] = {}

    def open(self, request_id: str, now: float) -> None:
        """A request admitted at `now`."""
        self._held[request_id] = RequestTimeline(admitted=now)

    def close(self, request_id: str, now: float) -> RequestTimeline | None:
        """The request's timeline, ended at `now` (None if it was never opened, or closed)."""
        timeline = self._held.pop(request_id, None)
        if timeline is not None:
            timeline.ended = now
        return timeline

    def retried(self, request_id: str) -> None:
        """Its worker died: it queues again (its queue wait and stages start over)."""
        timeline = self._held.get(request_id)
        if timeline is not None:
            self._held[request_id] = RequestTimeline(timeline.admitted, retries=timeline.retries + 1)

    def scheduled(self, work: RequestBatch | StepPlan, worker: int, now: float) -> None:
        """`work` is about to run on `worker`: its batch's requests (request mode), or the
        plan's joiners, leave the queue; the plan's paused requests count a preemption."""
        if isinstance(work, RequestBatch):
            leaving = work.requests
        else:
            leaving = work.join
            for request_id in work.paused:
                if (timeline := self._held.get(request_id)) is not None:
                    timeline.preemptions += 1
        for request in leaving:
            timeline = self._held.get(request.request_id)
            if timeline is not None and timeline.scheduled is None:
                timeline.scheduled, timeline.worker = now, worker

    def record(self, output: BatchOutput, *, stepping: bool) -> None:
        """What the executor reported ran: step-level (`stepping`) prepares, steps and
        decodes, or request-level forwards. Failed runs are left out (a retry follows)."""
        for forward in output.forwards:
            if forward.ok and not forward.interrupted:
                self._forward(forward, stepping=stepping)
        for prepare in output.prepares:
            interval = Interval(prepare.started, prepare.started + prepare.seconds)
            for timeline in self._of(prepare.request_ids):
                timeline.prepare = interval
        for decode in output.decodes:
            if decode.ok:
                interval = Interval(decode.started, decode.started + decode.seconds)
                for timeline in self._of(decode.request_ids):
                    timeline.decode, timeline.decode_size = interval, decode.num_requests

    def _forward(self, record: ForwardRecord, *, stepping: bool) -> None:
        ended = record.started + record.seconds
        for timeline in self._of(record.request_ids):
            if stepping:
                timeline.add_step(record.started, ended, record.num_requests, record.cache_blocks_skipped)
            else:
                timeline.forward = Interval(record.started, ended)
                timeline.batch_size = record.num_requests

    def _of(self, request_ids: tuple[str, ...]) -> list[RequestTimeline]:
        return [self._held[rid] for rid in request_ids if rid in self._held]
