"""What the gateway and the engine replicas send each other: small picklable values."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from engine.outputs import DecodeRecord, ForwardRecord, ModerationRecord
from engine.request import BatchKey, GenerationRequest, RequestOutput

if TYPE_CHECKING:
    from engine.spec import PipelineSpec


@dataclass(frozen=True, slots=True)
class RemoteCall:
    """One admitted request for a replica. `batch_key` is what the request router reads to
    keep compatible requests on one replica (the step key in step mode). `sent_at` is the
    gateway's `time.monotonic()` when it sent the call: the request's arrival and deadline
    are readings of the gateway's clock, which another machine does not share."""

    request: GenerationRequest
    batch_key: BatchKey
    sent_at: float = field(default_factory=time.monotonic)

    def on_this_clock(self) -> GenerationRequest:
        """The request with its arrival and deadline moved onto this process's monotonic
        clock, as if sent just now (the gateway keeps the true deadline: it cancels the
        call when it passes)."""
        shift = time.monotonic() - self.sent_at
        request = self.request
        deadline = None if request.deadline is None else request.deadline + shift
        return replace(request, arrival_time=request.arrival_time + shift, deadline=deadline)


@dataclass(frozen=True, slots=True)
class ReplicaInfo:
    """What the gateway needs to admit requests itself: the pipeline's pure calls (without
    weights) and how the replicas batch."""

    spec: PipelineSpec
    batching: str
    replica_id: str


@dataclass(frozen=True, slots=True)
class Progress:
    """A video request's denoising progress (steps done of total), for its job's `progress`."""

    done: int
    total: int


@dataclass(frozen=True, slots=True)
class Finished:
    """A request's end on a replica: its output or its error, with the forwards, decodes and
    safety checks the replica ran since it last answered (so the gateway's /metrics shows every replica's
    batches)."""

    replica_id: str
    output: RequestOutput | None = None
    error: Exception | None = None
    forwards: tuple[ForwardRecord, ...] = field(default_factory=tuple)
    decodes: tuple[DecodeRecord, ...] = field(default_factory=tuple)
    moderations: tuple[ModerationRecord, ...] = field(default_factory=tuple)
