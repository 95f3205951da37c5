"""`/health`, `/metrics` and `GET /v1/models`."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from engine.models.model_set import ModelSet
from server.errors import ERROR_RESPONSES
from server.protocol import ModelList
from server.state import State, require_api_key

router = APIRouter(responses=ERROR_RESPONSES)


@router.get("/health")
async def health(state: State) -> JSONResponse:
    if state.ready:
        engine = state.engine
        # What the profile run at start fitted (or why it measured nothing), when one ran.
        profile = {} if engine.profile is None else {"profile_run": engine.profile.as_dict()}
        reason = engine.unavailable
        if reason is not None:  # every worker process is restarting: no capacity for now
            return JSONResponse({"status": "degraded", "reason": reason}, status_code=503)
        workers = len(engine.lanes)
        if engine.workers_up < workers:  # still serving, with less capacity
            down = [
                f"worker {lane.label}: {lane.executor.health()}" for lane in engine.lanes if not lane.healthy
            ]
            return JSONResponse(
                {
                    "status": "ok",
                    "workers_up": engine.workers_up,
                    "workers": workers,
                    "reason": "; ".join(down),
                    **profile,
                }
            )
        return JSONResponse({"status": "ok", **profile, **_models(engine)})
    if state.engine.failure is not None:
        return JSONResponse({"status": "failed", "reason": state.engine.failure}, status_code=503)
    return JSONResponse({"status": "starting" if not state.shutting_down else "stopping"}, status_code=503)


def _models(engine: object) -> dict[str, object]:
    """Each of several models' state, and why one failed to load (it alone does not serve)."""
    if not isinstance(engine, ModelSet):
        return {}
    return {
        "models": {
            slot.name: {"state": slot.state, **({"reason": slot.failure} if slot.failure else {})}
            for slot in engine.slots.values()
        }
    }


# Load balancers and probes often ask with HEAD.
router.add_api_route("/health", health, methods=["HEAD"], include_in_schema=False)


@router.get("/metrics", dependencies=[Depends(require_api_key)], response_class=PlainTextResponse)
async def metrics(state: State) -> Response:
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models", dependencies=[Depends(require_api_key)])
async def list_models(state: State) -> ModelList:
    engine = state.engine
    states: dict[str, tuple[str, bool, str | None]]
    if isinstance(engine, ModelSet):
        states = {
            name: (slot.modality, slot.state == "loaded", slot.state) for name, slot in engine.slots.items()
        }
    else:
        states = {state.models.default.base: (engine.modality, engine.is_running, None)}
    return ModelList(data=state.models.cards(state.created, states))
