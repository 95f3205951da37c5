"""`/health`, `/metrics` and `GET /v1/models`.

`/health` is open (probes send no key), so it says each model's state but why one failed
(exception text, local paths) only to a caller the API key check admits: with `--api-key`,
one that sends a key; without keys, every caller, as every other route. The full reason
is always in the log.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Header, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from engine.core.service import EngineService
from server.errors import ERROR_RESPONSES, APIError
from server.protocol import ModelList
from server.state import AppState, State, require_api_key

router = APIRouter(responses=ERROR_RESPONSES)

# What a caller without a key reads instead of a failure's reason.
HIDDEN = "the reason is in the server log (and in /health for a caller with an API key)"


@router.get("/health")
async def health(
    state: State, request: Request, authorization: Annotated[str | None, Header()] = None
) -> JSONResponse:
    detail = await _admitted(request, authorization)
    body, status = _health(state, detail)
    return JSONResponse(body, status_code=status)


async def _admitted(request: Request, authorization: str | None) -> bool:
    """Whether the caller passes the API key check (everyone does without keys)."""
    try:
        await require_api_key(request, authorization)
    except APIError:
        return False
    return True


def _health(state: AppState, detail: bool) -> tuple[dict[str, object], int]:
    """The body and status of `/health`: 200 while the server can generate, naming what is
    degraded meanwhile (`degraded`: the job store unavailable leaves images served, video
    routes 503), never asking a database itself (a frozen one would freeze the answer);
    failure reasons only with `detail`."""
    if state.ready:
        engine = state.engine
        # What the profile run at start fitted (or why it measured nothing), when one ran.
        profile: dict[str, object] = (
            {} if engine.profile is None else {"profile_run": engine.profile.as_dict()}
        )
        profile.update(_degraded(state, detail))
        reason = engine.unavailable
        if reason is not None:  # every worker process is restarting: no capacity for now
            return {"status": "degraded", "reason": why(reason, detail)}, 503
        workers = engine.worker_health()
        if workers.up < workers.workers:  # still serving, with less capacity
            up = {"workers_up": workers.up, "workers": workers.workers}
            return {"status": "ok", **up, "reason": why("; ".join(workers.down), detail), **profile}, 200
        return {"status": "ok", **profile, **_models(engine, detail)}, 200
    if state.engine.failure is not None:
        return {"status": "failed", "reason": why(state.engine.failure, detail)}, 503
    return {"status": "starting" if not state.shutting_down else "stopping"}, 503


def why(reason: str, detail: bool) -> str:
    """A failure's reason, or with no `detail` where to read it."""
    return reason if detail else HIDDEN


def _degraded(state: AppState, detail: bool) -> dict[str, object]:
    """What works less than it should while the server still serves (its reason, which may
    name the database's host, only with `detail`)."""
    store = None if state.videos is None else state.videos.store.status()
    if store is None or store["status"] == "ok":
        return {}
    if "reason" in store:
        store["reason"] = why(str(store["reason"]), detail)
    return {"degraded": {"job_store": store}}


def _models(engine: EngineService, detail: bool) -> dict[str, object]:
    """Each of several models' state, and why one failed to load (it alone does not serve)."""
    several = engine.model_set_status()
    if several is None:
        return {}
    models: dict[str, object] = {}
    for name, model in several.models.items():
        reason = {} if model.failure is None else {"reason": why(model.failure, detail)}
        models[name] = {"state": model.state, **reason}
    return {"models": models}


# Load balancers and probes often ask with HEAD.
router.add_api_route("/health", health, methods=["HEAD"], include_in_schema=False)


@router.get("/metrics", dependencies=[Depends(require_api_key)], response_class=PlainTextResponse)
async def metrics(state: State) -> Response:
    return Response(await state.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models", dependencies=[Depends(require_api_key)])
async def list_models(state: State) -> ModelList:
    engine = state.engine
    states: dict[str, tuple[str, bool, str | None]]
    several = engine.model_set_status()
    if several is not None:
        states = {name: (m.modality, m.state == "loaded", m.state) for name, m in several.models.items()}
    else:
        states = {state.models.default.base: (engine.modality, engine.is_running, None)}
    return ModelList(data=state.models.cards(state.created, states))
