"""The scheduling-priority settings of `ServeSettings` (a base it inherits, so each is a flag
and a YAML key like the rest). A request's own `priority` and its API key's default
(`--api-key KEY:priority=N`, `server.api_keys`) say who runs first; aging, here, says how
long a worse priority may be passed over (`engine.sched.priority`)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from engine.sched.priority import DEFAULT_AGING_S


class PrioritySettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    priority_aging_s: float = Field(
        DEFAULT_AGING_S,
        gt=0,
        allow_inf_nan=False,
        description="seconds of waiting that improve a request's priority by one level, so none "
        "starves: a request P levels worse waits behind better work for at most P times this",
    )
