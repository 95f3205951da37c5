"""When a client polling a video job should ask again (`openai-poll-after-ms`).

The official client's `create_and_poll` reads the header of its first poll only and keeps
that interval for the whole job, and that first poll comes right after the create, while
the job is queued. So the interval a queued job suggests is what matters most: a fixed
second made a 100 ms video a second late. It is now a quarter of what the model's recent
videos took (`JobDurations`), up to that second; a job in progress says a quarter of what
its progress says is left.
"""

from __future__ import annotations

from server.jobs.model import VideoJob

# Bounds of the suggested interval, and the most a job without progress suggests.
POLL_MIN_MS, POLL_MAX_MS, POLL_QUEUED_MS = 50, 5000, 1000
# How much a finished video moves a model's typical duration (an exponential average).
_WEIGHT = 0.3


class JobDurations:
    """How long each model's videos took lately, from their submission to their end (this
    process's jobs: each API process learns from its own)."""

    def __init__(self) -> None:
        self._typical_s: dict[str, float] = {}

    def note(self, model: str, seconds: float) -> None:
        before = self._typical_s.get(model)
        self._typical_s[model] = seconds if before is None else before + _WEIGHT * (seconds - before)

    def typical_s(self, model: str) -> float | None:
        return self._typical_s.get(model)


def poll_after_ms(job: VideoJob, now: float, typical_s: float | None = None) -> int | None:
    """A quarter of the time left, within bounds: left by the job's progress once it has
    some, else by its model's typical duration (`typical_s`) up to `POLL_QUEUED_MS`, else
    `POLL_QUEUED_MS`; None once the job has ended."""
    if job.status not in ("queued", "in_progress"):
        return None
    elapsed_ms = max(0.0, now - job.created_at) * 1000
    if job.status == "in_progress" and job.progress > 0:
        remaining_ms = elapsed_ms * (100 - job.progress) / job.progress
        return int(min(POLL_MAX_MS, max(POLL_MIN_MS, remaining_ms / 4)))
    if typical_s is None:
        return POLL_QUEUED_MS
    remaining_ms = max(0.0, typical_s * 1000 - elapsed_ms)
    return int(min(POLL_QUEUED_MS, max(POLL_MIN_MS, remaining_ms / 4)))
