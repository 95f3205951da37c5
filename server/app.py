"""`create_app(settings)`: the FastAPI app. The model loads in the lifespan, in the background.

The server answers at once while the model loads (`/health` is 503 until the engine is
ready), so orchestrators can tell "loading" from "dead". If loading fails, the error is
logged and `app.state.request_shutdown` (set by the CLI) stops the server, so a bad model
never serves 503s forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI

from engine.core.engine import AsyncEngine
from engine.core.service import EngineService
from engine.errors import EngineError, EngineNotRunningError, InvalidRequestError
from engine.executor.abstract import Executor
from engine.models.model_set import ModelSet, ModelSlot
from pipelines.memory.estimate import estimated_weight_bytes
from server.composition import lane_group_executor, process_executor, thread_executor
from server.cross_site import BrowserCORSMiddleware, CrossSiteMiddleware
from server.errors import (
    describe_errors_in_openapi,
    error_response,
    from_engine_error,
    install_error_handlers,
)
from server.image_store import ImageStore
from server.key_limits import KeyLimits, KeyLimitsCollector, KeyLimitsService
from server.metrics import Metrics
from server.middleware import BodyLimitMiddleware, MetricsMiddleware, RequestIdMiddleware
from server.outputs.opening import open_output_store
from server.result_cache import ResultCacheService, result_cache_for
from server.routes import edits, images, playground, system, unsupported, variations, videos
from server.settings import ModelEntry, ServeSettings
from server.state import AppState
from server.tenants import Tenants
from server.tracing.start import start_tracing
from server.videos.start import start_videos

logger = logging.getLogger(__name__)


def build_executors(settings: ServeSettings) -> list[Executor]:
    """One executor per data-parallel lane, each with its own device (with `--cfg-parallel`
    or `--sequence-parallel` its own devices) (and profiling it at start, `--profile-run`)."""
    profile = settings.profile_plan(settings.max_num_seqs, settings.max_step_tokens)
    if settings.lane_shape.size > 1:  # lanes of several devices (`engine.executor.lane_group`)
        timeout_s = settings.worker_start_timeout_s
        return [lane_group_executor(lane, timeout_s, profile) for lane in settings.lane_configs()]
    if settings.executor_kind == "process":
        return [
            process_executor(c, settings.decode_overlap, settings.worker_start_timeout_s, profile)
            for c in settings.worker_configs()
        ]
    return [thread_executor(settings.pipeline_config(), settings.decode_overlap, profile)]


def build_engine(settings: ServeSettings) -> EngineService:
    """One engine hosting `settings.model`, or with several `models` a `ModelSet` making
    each model's engine when it is first used."""
    if not settings.models:
        return AsyncEngine(build_executors(settings), settings.engine_config())

    def make(own: ServeSettings) -> EngineService:
        return AsyncEngine(build_executors(own), own.engine_config())

    def slot(entry: ModelEntry) -> ModelSlot:
        own = settings.for_entry(entry)
        device = own.device.split(",")[0].strip()
        estimate = functools.partial(estimated_weight_bytes, own.model, own.dtype, device)
        return ModelSlot(entry.name, functools.partial(make, own), preload=entry.preload, estimate=estimate)

    slots = [slot(entry) for entry in settings.models]
    return ModelSet(slots, settings.models_budget_bytes(), host_budget_bytes=settings.host_budget_bytes())


def create_app(
    settings: ServeSettings,
    engine: EngineService | None = None,
    engine_metrics: Callable[[], Awaitable[bytes]] | None = None,
    *,
    key_limits: KeyLimitsService | None = None,
    result_cache: ResultCacheService | None = None,
) -> FastAPI:
    """Build the app; `engine` defaults to one hosting `settings.model` in a thread, or in
    worker processes (`executor: process`, `data_parallel_size`), or several models'.
    `engine_metrics`: the engine is in another process, which observes it (metrics, engine
    spans) and answers this text of its live metrics (`server.api_servers`). `key_limits`
    and `result_cache`: counted and kept in that process too, which reports them; by
    default here (`settings.api_key_entries`, `settings.result_cache_mb`)."""
    if engine is None:
        engine = build_engine(settings)
    outputs = open_output_store(settings, settings.output_dir)
    tracing = start_tracing(settings)
    observer = tracing.engine_observer() if engine_metrics is None else None
    if observer is not None:
        engine.observers.append(observer)
    state = AppState(
        settings=settings,
        engine=engine,
        metrics=Metrics(engine_metrics),
        outputs=outputs,
        image_store=ImageStore(outputs, settings.image_url_ttl_s),
        tenants=Tenants.from_secret(settings.tenant_secret),
        tracing=tracing,
    )
    if key_limits is None:  # counted here, and reported by this process's /metrics
        key_limits = KeyLimits(settings.api_key_entries)
        state.metrics.watch(KeyLimitsCollector(key_limits))
    if result_cache is None:  # kept here (None: off), and reported by this process's /metrics
        own_cache = result_cache_for(settings.result_cache_mb)
        if own_cache is not None:
            state.metrics.watch_result_cache(own_cache)
        result_cache = own_cache
    state.key_limits, state.result_cache = key_limits, result_cache
    # With a key, the API description is not public either (a browser cannot send the key
    # when /docs fetches it).
    public = settings.api_key is None and not settings.disable_docs
    app = FastAPI(
        title="diffbatch",
        version="0.1.0",
        lifespan=_lifespan,
        docs_url="/docs" if public else None,
        redoc_url="/redoc" if public else None,
        openapi_url="/openapi.json" if public else None,
        telemetry=tracing.fastapi_telemetry(),
    )
    app.state.diffbatch = state
    app.state.startup_error = None
    app.state.request_shutdown = None
    install_error_handlers(app)
    describe_errors_in_openapi(app)

    @app.exception_handler(EngineError)
    @app.exception_handler(InvalidRequestError)
    async def _engine_error(_: object, exc: Exception):  # type: ignore[no-untyped-def]
        error = from_engine_error(exc)
        if error.status == 429 and error.code is not None:
            # Refused at admission, never queued: counted by why (queue_full, deadline_unmeetable).
            state.metrics.refused.labels(reason=error.code).inc()
        return error_response(error)

    app.include_router(images.router)
    app.include_router(images.files_router)
    app.include_router(edits.router)
    app.include_router(variations.router)
    app.include_router(system.router)
    app.include_router(unsupported.router)  # before videos: /v1/videos/edits is not a video id
    app.include_router(videos.router)
    if not settings.disable_playground:
        app.include_router(playground.router)
    app.add_middleware(BodyLimitMiddleware, max_bytes=int(settings.max_body_mb * 1024 * 1024))
    if settings.allowed_origin_list:
        app.add_middleware(BrowserCORSMiddleware, allow_origins=settings.allowed_origin_list)
    app.add_middleware(
        CrossSiteMiddleware,
        allowed_hosts=settings.allowed_host_list,
        has_api_key=settings.api_key is not None,
        allowed_origins=settings.allowed_origin_list,
    )
    app.add_middleware(RequestIdMiddleware)
    app.add_middleware(MetricsMiddleware, metrics=state.metrics)  # outermost: it counts refusals too
    return app


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    state: AppState = app.state.diffbatch
    store, sender = await start_videos(state)
    loading = asyncio.create_task(_start_engine(app, state), name="diffbatch-load-model")
    cleanup = asyncio.create_task(purge_forever(state), name="diffbatch-cleanup")
    try:
        yield
    finally:
        state.shutting_down = True
        drain = getattr(app.state, "drain", None)
        if drain is not None:
            drain.cancel()
        for task in (loading, cleanup):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if state.videos is not None:
            await state.videos.stop()
        await state.engine.stop()
        if sender is not None:
            await sender.close()
        if store is not None:
            await store.close()
        await asyncio.to_thread(state.tracing.shutdown)  # the last requests' spans are sent
        state.encoder.close()
        logger.info("engine stopped")


# Left at the end of the shutdown timeout to answer unfinished requests before uvicorn
# cancels them.
DRAIN_MARGIN_S = 1.0


def begin_drain(app: FastAPI) -> None:
    """Shutdown has begun (SIGTERM): take no new work (503), let work in flight finish, and
    answer what is still unfinished with 503 just before the shutdown timeout ends."""
    state: AppState = app.state.diffbatch
    if state.shutting_down:
        return
    state.shutting_down = True
    grace = max(0.0, state.settings.shutdown_timeout_s - DRAIN_MARGIN_S)
    logger.info(
        "shutting down: no new requests; %d waiting and %d running have %.0f s to finish",
        state.engine.num_waiting,
        state.engine.num_running,
        grace,
    )
    app.state.drain = asyncio.get_running_loop().create_task(_end_unfinished_after(state, grace))


async def _end_unfinished_after(state: AppState, grace: float) -> None:
    await asyncio.sleep(grace)
    error = EngineNotRunningError("the server is shutting down and this request did not finish in time")
    unfinished = state.engine.abort_all(error)
    if unfinished:
        logger.warning("shutdown: %d requests did not finish in time; answered 503", unfinished)


# Longest time between two cleanups.
PURGE_INTERVAL_S = 60.0


def purge_interval_s(settings: ServeSettings) -> float:
    """How often the cleanup runs: four times per time-to-live, at most a minute apart, so what
    expires is gone within a quarter of its life after (not up to a whole one)."""
    return min(PURGE_INTERVAL_S, min(settings.image_url_ttl_s, settings.video_ttl_s) / 4)


async def purge_forever(state: AppState) -> None:
    """Remove expired URL images and videos, and files no job owns, every `purge_interval_s`
    (cancel to stop). An error is logged and the next round tries again."""
    while True:
        await asyncio.sleep(purge_interval_s(state.settings))
        try:
            await purge_once(state)
        except Exception:
            logger.exception("cleanup of expired files failed; trying again in a minute")


async def purge_once(state: AppState) -> None:
    images = await asyncio.to_thread(state.image_store.purge_expired)
    videos = orphans = 0
    if state.videos is not None:
        service = state.videos
        videos = await service.purge_expired()
        orphans = await service.purge_orphans()
    if images or videos or orphans:
        logger.info(
            "removed %d expired images, %d expired videos, %d orphaned files", images, videos, orphans
        )


def refused_flag(error: BaseException) -> str | None:
    """The flag a loader refused (its error's `flag`: `MemorySettingError`, the worker's
    `SettingRefusedError`, ...), or None for any other failure."""
    flag = getattr(error, "flag", None)
    return flag if isinstance(flag, str) else None


async def _start_engine(app: FastAPI, state: AppState) -> None:
    if state.is_model_set:
        # Bound first: the preloads' states, loads and failures show in /metrics as they happen.
        state.metrics.bind(state.engine)
        await state.engine.start()  # the preloaded models; a failure is only that model's
        logger.info("serving models %s", ", ".join(repr(s.base) for s in state.models.bases))
        return
    logger.info("loading model %s", state.settings.model)
    try:
        await state.engine.start()
    except Exception as exc:
        if refused_flag(exc) is not None:  # a setting the loader refused: one line, no traceback
            logger.error("could not load model %s: %s; stopping the server", state.settings.model, exc)
        else:
            logger.exception("could not load model %s; stopping the server", state.settings.model)
        app.state.startup_error = exc
        if app.state.request_shutdown is not None:
            app.state.request_shutdown()
        return
    state.metrics.bind(state.engine)
    logger.info("serving %r (model %s)", state.settings.model_name, state.settings.model)
