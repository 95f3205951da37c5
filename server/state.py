"""What the routes share: settings, the engine, metrics, the output store."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Annotated, Any, TypeVar

from fastapi import Depends, Header, Request
from starlette.datastructures import FormData

from engine.core.service import EngineService
from server.api_keys import ApiKey
from server.control_modes import union_modes
from server.encoding_pool import EncodingPool
from server.errors import APIError, ClientDisconnectedError
from server.image_store import ImageStore
from server.key_limits import KeyLimits, KeyLimitsService
from server.metrics import Metrics
from server.models import ServedModelList, ServedModels
from server.outputs.store import OutputStore
from server.result_cache import ResultCacheService
from server.settings import ServeSettings
from server.tenants import Tenants
from server.tracing.tracing import TRACING_OFF, Tracing
from server.videos.service import VideoService

_T = TypeVar("_T")


@dataclass(slots=True)
class AppState:
    settings: ServeSettings
    engine: EngineService
    metrics: Metrics
    outputs: OutputStore  # where video files and url images are kept
    image_store: ImageStore
    created: int = field(default_factory=lambda: int(time.time()))
    shutting_down: bool = False
    # Opened in the lifespan (it writes under output_dir), not at app construction.
    videos: VideoService | None = None
    videos_error: str | None = None  # why there is no video service, when it could not open
    _models: ServedModelList | None = field(default=None, repr=False)  # built once, from settings
    # `--result-cache-mb` (`server.result_cache`: here, or the engine process's); None when off.
    result_cache: ResultCacheService | None = None
    # Each API key's `max_queue` and `rate` (`server.key_limits`: here, or counted in the
    # engine process); empty without keys.
    key_limits: KeyLimitsService = field(default_factory=KeyLimits)
    # Whose a video job is and whose a caller sees (`server.tenants`), by `--tenant-secret`.
    tenants: Tenants = field(default_factory=Tenants)
    # Traces of the API requests (`--otlp-traces-endpoint`); off, every call does nothing.
    tracing: Tracing = TRACING_OFF
    # One of several API processes (`--api-server-count`): its supervisor's run, which names
    # the owner of every job its processes run (`server.jobs.sqlite`); None in one process.
    server_run: str | None = None
    # Where image answers are encoded (`server.encoding_pool`): its threads start on first use.
    encoder: EncodingPool = field(default_factory=EncodingPool)

    @property
    def allowed_hosts(self) -> list[str]:
        return self.settings.allowed_host_list

    @property
    def ready(self) -> bool:
        return self.engine.is_running and not self.shutting_down

    def video_service(self) -> VideoService:
        if self.videos is None:
            if self.videos_error is not None:
                raise APIError(
                    503, self.videos_error, type="server_error", code="video_store_unavailable", retry=False
                )
            raise APIError(503, "the server is not ready", type="server_error", code="engine_not_ready")
        return self.videos

    def check_accepting(self) -> None:
        """No new work once shutdown has begun (SIGTERM): 503, retry on another server."""
        if self.shutting_down:
            raise APIError(
                503,
                "the server is shutting down; send the request again",
                type="server_error",
                code="shutting_down",
            )

    async def engine_for(
        self,
        model: str | None,
        endpoint_modality: str | tuple[str, ...],
        endpoint: str,
        deadline: float | None = None,
    ) -> EngineService:
        """The engine serving `model` (a base, one of its adapters, or None: the default),
        loaded if need be, waiting for a load until the request's `deadline` (a monotonic
        time; None: `--request-timeout-s`): 404 for a model this server does not serve, 400
        for one whose modality `endpoint` cannot use."""
        served = self.models.base_of(model)
        wait_s = (
            self.settings.request_timeout_s if deadline is None else max(0.0, deadline - time.monotonic())
        )
        if self.is_model_set:  # only then may it have to load (and perhaps unload another first)
            with self.tracing.span("model load", {"diffbatch.model": served.base}):
                engine = await self.engine.engine_for(served.base, wait_s)
        else:
            engine = await self.engine.engine_for(served.base, wait_s)
        check_modality(
            engine.modality, endpoint_modality, endpoint, served.base if self.is_model_set else None
        )
        return engine

    def check_endpoint(
        self, model: str | None, endpoint_modality: str | tuple[str, ...], endpoint: str
    ) -> None:
        """What `engine_for` refuses, without loading anything: 404 for a model this server
        does not serve, 400 for one whose modality (once known) `endpoint` cannot use. So a
        request answered from the result cache never loads (nor evicts for) its model."""
        served = self.models.base_of(model)
        several = self.engine.model_set_status()
        if several is not None:  # "unknown" until the model has loaded once
            check_modality(several.models[served.base].modality, endpoint_modality, endpoint, served.base)
        else:
            check_modality(self.engine.modality, endpoint_modality, endpoint)

    @property
    def is_model_set(self) -> bool:
        """Whether the engine serves several models (each named in errors and /health)."""
        return self.engine.model_set_status() is not None

    @property
    def models(self) -> ServedModelList:
        if self._models is None:
            self._models = ServedModelList(
                tuple(
                    ServedModels(
                        s.model_name,
                        tuple(s.lora_modules),
                        tuple(s.controlnet),
                        tuple(s.ip_adapter),
                        union_modes(s.controlnet),
                    )
                    for s in self.settings.per_model()
                )
            )
        return self._models

    def check_model(self, model: str | None) -> None:
        """404 for a model this server does not serve (a base or one of its adapters)."""
        self.models.lora_for(model, None)


def check_modality(
    modality: str, endpoint_modality: str | tuple[str, ...], endpoint: str, name: str | None = None
) -> None:
    """Refuse an endpoint that a model of `modality` cannot answer (known once it has loaded);
    an endpoint that several modalities can answer names them all."""
    # A model whose references are optional (FLUX.2) answers both image endpoints.
    served = ("image", "edit") if modality == "image+edit" else (modality,)
    usable = (endpoint_modality,) if isinstance(endpoint_modality, str) else endpoint_modality
    if not set(usable) & set(served) and modality != "unknown":
        model = "this server serves a" if name is None else f"the model {name!r} is a"
        raise APIError(
            400,
            f"{model} {modality} model, which {endpoint} cannot use",
            param="model",
            code="unsupported_model",
        )


def get_state(request: Request) -> AppState:
    state: AppState = request.app.state.diffbatch
    return state


State = Annotated[AppState, Depends(get_state)]


async def require_api_key(request: Request, authorization: Annotated[str | None, Header()] = None) -> None:
    """When API keys are set, `/v1/*` and `/metrics` need `Authorization: Bearer KEY`, one of
    them (each compared in constant time). The key's entry (its settings) is kept on the
    request's state as `api_key`, for `caller_priority`, `caller_timeout` and the scheduling
    that reads them."""
    keys = get_state(request).settings.api_key_entries
    if not keys:
        return
    scheme, _, given = (authorization or "").partition(" ")
    token = given.strip().encode()
    matches = [secrets.compare_digest(token, entry.key.encode()) for entry in keys]  # all compared
    if scheme.lower() != "bearer" or not any(matches):
        raise APIError(
            401,
            "missing or invalid API key: send 'Authorization: Bearer <key>'",
            code="invalid_api_key",
        )
    request.state.api_key = keys[matches.index(True)]


def caller_key(request: Request) -> ApiKey | None:
    """The API key entry the request was sent with (`require_api_key`); None without keys."""
    key: ApiKey | None = getattr(request.state, "api_key", None)
    return key


def caller_timeout(request: Request, server_timeout_s: float | None, asked: float | None) -> float | None:
    """Seconds from a request's arrival to its deadline: as it asked (`timeout`), up to its
    default: its API key's SLO (`--api-key KEY:slo=SECONDS`), else the server's timeout for
    its kind of work."""
    key: ApiKey | None = getattr(request.state, "api_key", None)
    default = server_timeout_s if key is None or key.slo is None else key.slo
    if asked is None:
        return default
    return asked if default is None else min(asked, default)


def caller_priority(request: Request, asked: int | None) -> int:
    """A request's scheduling priority: as it asked, else its API key's, else 0. A key's
    priority is also the best its requests may ask for (400 naming `priority` past it):
    otherwise any key could push every other key's work behind its own."""
    key = caller_key(request)
    if key is None:
        return 0 if asked is None else asked
    if asked is not None and asked < key.priority:
        raise APIError(
            400,
            f"priority {asked} is better than this API key may ask for: its requests run at "
            f"priority {key.priority} or a worse (higher) one",
            param="priority",
            code="priority_not_allowed",
        )
    return key.priority if asked is None else asked


def caller_tenant(request: Request) -> str | None:
    """The tenant the request acts as: whose the video jobs it creates are (`server.tenants`);
    None without keys."""
    return get_state(request).tenants.of(caller_key(request))


def caller_view(request: Request) -> str | None:
    """The tenant whose video jobs the request sees: its own; None (every job) for an admin
    key or without keys. Another tenant's job is a 404, as if it did not exist."""
    return get_state(request).tenants.seen_by(caller_key(request))


async def require_json(request: Request) -> None:
    """A JSON endpoint takes `application/json` only: a form or `text/plain` body is what a
    foreign web page can send without a CORS preflight (415)."""
    require_media_type(request, ("application/json",), "application/json")


def require_media_type(request: Request, accepted: tuple[str, ...], wanted: str) -> str:
    """The request's media type if it is one of `accepted` (or `+json` where JSON is), else 415."""
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media in accepted or ("application/json" in accepted and media.endswith("+json")):
        return media
    raise APIError(
        415,
        f"send the body as {wanted}, not {media or 'a body without a content type'}",
        code="unsupported_media_type",
    )


def request_id_of(request: Request) -> str | None:
    """The id `RequestIdMiddleware` gave this HTTP request (the client's X-Request-Id or a
    fresh one); None outside that middleware (tests that build the app differently)."""
    request_id: str | None = getattr(request.state, "request_id", None)
    return request_id


def form_fields(form: FormData, file_fields: tuple[str, ...]) -> dict[str, Any]:
    """A form's fields other than `file_fields`, each given once (400 naming a repeated one:
    silently keeping the last of two prompts would answer a question nobody asked)."""
    fields: dict[str, Any] = {}
    for key, value in form.multi_items():
        if key in file_fields:
            continue
        if key in fields:
            raise APIError(400, f"{key} is given more than once; send it once", param=key)
        fields[key] = value
    return fields


async def until_disconnected(request: Request, work: Awaitable[_T]) -> _T:
    """Await `work`, cancelling it if the client disconnects first.

    Cancelling `engine.generate` aborts the request in the engine: a waiting request never
    runs, and a running one's result is dropped.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.create_task(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise ClientDisconnectedError
    finally:
        watcher.cancel()
        # If this handler itself is cancelled, the work must not outlive it.
        task.cancel()


async def _wait_for_disconnect(request: Request) -> None:
    # The body has been read already, so the next ASGI message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass
