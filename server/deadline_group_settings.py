"""The deadline-aware step groups setting of `ServeSettings` (a base it inherits, so it is a
flag and a YAML key like the rest): in step-level batching, whether worse-priority rows are
held back from a step that would make a better-priority request miss its deadline
(`engine.sched.step_groups`)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from server.switches import Switch


class DeadlineGroupSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    deadline_groups: Switch = Field(
        "on",
        description="step-level batching: rows of worse priority step beside a request with a "
        "deadline (its timeout, or its API key's slo) only while the learnt step time keeps it "
        "on track; the others wait, with their state, until it finishes or has slack "
        "(off: every running request of the step key steps together)",
    )
