"""What an API process and the engine process send each other over their socket: small
picklable values, as the Ray Serve gateway and its replicas send (`server.ray_serve.messages`,
whose `Progress` and `Finished` are reused here). One connection carries every request of
one API process, so each request's event travels in a `ForRequest` envelope naming it.

What several API processes must count or keep once for the whole server — each API key's
`max_queue` and `rate` (`AdmitKey`, `ChargeKey`, `ReleaseKey`, and a `Submit`'s `ticket`)
and the result cache (`CacheGet`, `CachePut`) — is in the engine process, which every
request passes through; these calls reach it."""

from __future__ import annotations

from dataclasses import dataclass

from engine.core.lanes import WorkerHealth
from engine.core.service import ModelSetStatus
from engine.logs import RequestContext
from engine.request import GenerationRequest, PartialImage
from engine.spec import PipelineSpec
from engine.worker.profile_run import ProfileResult
from server.ray_serve.messages import Finished, Progress
from server.result_cache import CachedImages

__all__ = [
    "Abort",
    "AdmitKey",
    "Admitted",
    "AskMetrics",
    "CacheGet",
    "CachePut",
    "ChargeKey",
    "Claim",
    "Claimed",
    "Finished",
    "ForRequest",
    "Progress",
    "Release",
    "ReleaseKey",
    "Reply",
    "Snapshot",
    "Started",
    "Submit",
]

# API process -> engine process ------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Claim:
    """`engine_for(model)` of a server of several models: load it if need be (waiting at
    most `timeout_s`) and hold it for one request until `Submit` or `Release`."""

    call_id: int
    model: str | None
    timeout_s: float | None


@dataclass(frozen=True, slots=True)
class Release:
    """The claim `claim_id` was dropped without a submit (a refusal, a client gone)."""

    claim_id: int


@dataclass(frozen=True, slots=True)
class Submit:
    """Admit `request` (to the model of `claim_id` where there are several), and send its
    events: `Admitted` or its refusal, previews, with `progress` its batch's start and each
    step's progress (a video job's), then its end. `ticket`: its key's count (`AdmitKey`),
    which the engine process now drops when the request ends, or at once if it refuses it.
    `log_context`: what the API process's log lines say of the request (its model, its
    tenant), for the engine process's (`queued`, `finished`)."""

    request: GenerationRequest
    claim_id: int | None = None
    progress: bool = False
    ticket: int | None = None
    log_context: RequestContext | None = None


@dataclass(frozen=True, slots=True)
class Abort:
    request_id: str


@dataclass(frozen=True, slots=True)
class AdmitKey:
    """Count one more request of the API key named `key` (`KeyLimits.admit`) and answer the
    ticket it is held under (`call_id`: unique for the API process's life), or its 429. The
    count is the ticket's until a `Submit` carries it or a `ReleaseKey` drops it."""

    call_id: int
    key: str


@dataclass(frozen=True, slots=True)
class ReleaseKey:
    """The request of `ticket` ends without a submit (a refusal here, a client gone)."""

    ticket: int


@dataclass(frozen=True, slots=True)
class ChargeKey:
    """Take one of `key`'s rate tokens for a request the engine never holds (a result-cache
    hit, `KeyLimits.charge`), or answer its 429."""

    call_id: int
    key: str


@dataclass(frozen=True, slots=True)
class CacheGet:
    """The result cache's entry for `key`, counted as a hit, or None, counted as a miss."""

    call_id: int
    key: str


@dataclass(frozen=True, slots=True)
class CachePut:
    """Keep `entry` under `key`; answered once kept, so a repeat sent through any API
    process after the first answer finds it."""

    call_id: int
    key: str
    entry: CachedImages


@dataclass(frozen=True, slots=True)
class AskMetrics:
    """The engine process's live collectors as Prometheus text (`server.metrics`)."""

    call_id: int


# Engine process -> API process ------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What `/health`, `/v1/models` and a route's checks read of the engine, sent on connect
    and every `SNAPSHOT_PERIOD_S`. `spec` rides along only when it changed (the weightless
    pipeline: the client admits and prepares inputs with it), as `None` otherwise."""

    is_running: bool
    failure: str | None
    unavailable: str | None
    workers_up: int
    workers: WorkerHealth
    modality: str
    batching: str
    num_waiting: int
    num_running: int
    num_unfinished: int
    input_bytes: int
    weight_bytes: int
    profile: ProfileResult | None
    models: ModelSetStatus | None
    spec: PipelineSpec | None = None


@dataclass(frozen=True, slots=True)
class Admitted:
    """The engine took the request (`RequestHandle.accepted` returns)."""


@dataclass(frozen=True, slots=True)
class Started:
    """The request's batch started (a video job is `in_progress` from then)."""


@dataclass(frozen=True, slots=True)
class ForRequest:
    request_id: str
    event: Admitted | Started | PartialImage | Progress | Finished


@dataclass(frozen=True, slots=True)
class Claimed:
    """`Claim` answered: the model's claim and modality, and its spec unless this connection
    has it already for the engine now loaded (`spec_version` names which)."""

    claim_id: int
    model: str
    modality: str
    spec_version: int
    spec: PipelineSpec | None


@dataclass(frozen=True, slots=True)
class Reply:
    """The answer to the call `call_id` (`Claim`, `AskMetrics`, `AdmitKey`, `ChargeKey`,
    `CacheGet`, `CachePut`): a value, or why not (a key's 429 among them)."""

    call_id: int
    value: Claimed | bytes | CachedImages | int | None = None
    error: Exception | None = None
