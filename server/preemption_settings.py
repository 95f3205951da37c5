"""The preemption setting of `ServeSettings` (a base it inherits, so it is a flag and a YAML key
like the rest): in step-level batching, whether running requests pause for a waiting one of
strictly better priority that cannot join, or for one of a key under its fair share
(`engine.sched.preemption`)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from server.switches import Switch


class PreemptionSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    preemption: Switch = Field(
        "on",
        description="step-level batching: when a request of strictly better priority cannot join "
        "(max_num_seqs or max_step_tokens full), running requests of worse priority pause, "
        "keeping their state, and resume from the same step when room frees; so do running requests "
        "of a key over its fair share for a key under its own, at one priority (off: they run on)",
    )

    @property
    def preempts(self) -> bool:
        return self.preemption == "on"
