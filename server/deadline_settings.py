"""The deadline settings of `ServeSettings` (a base it inherits, so each is a flag and a YAML
key like the rest). A request's deadline comes from `--request-timeout-s` (video jobs:
`--video-timeout-s`) or its API key's SLO (`--api-key KEY:slo=SECONDS`, `server.api_keys`);
here, whether a deadline the work ahead would make it miss is refused at once
(`engine.sched.deadline_admission`)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from server.switches import Switch


class DeadlineSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    deadline_admission: Switch = Field(
        "on",
        description="refuse at once (429 with Retry-After and the estimate) a request that the work "
        "ahead of it would make finish past its deadline, instead of running it late; estimated "
        "from the step times measured on finished work (none measured yet: admitted); off: "
        "every request is queued and one past its deadline gets 504",
    )
