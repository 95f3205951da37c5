"""A request's arrival in the logs: its id, model and tenant (the API key's digest, as its
jobs are stored: `server.tenants`) bound for every line logged while it is handled (the
engine's `queued` and `finished` events included, `engine.logs`), and its `received` event."""

from __future__ import annotations

from fastapi import Request

from engine.logs import REQUEST, RequestContext, log_event
from server.state import caller_tenant, get_state, request_id_of


def received(request: Request, model: str | None, endpoint: str) -> None:
    """Bind the request's context and log that it arrived at `endpoint`, for `model` (None:
    the server's default model)."""
    request_id = request_id_of(request)
    if request_id is None:  # an app built without its middleware (some tests): nothing to name
        return
    model = model or get_state(request).settings.model_name
    REQUEST.set(RequestContext(request_id, model, caller_tenant(request)))
    log_event("received", "request %s received at %s", request_id, endpoint)
