"""A model's batching and scheduling settings, each a flag and a YAML key (`ServeSettings`
inherits these groups): how many images share a forward or a step, how long an idle engine
waits for more, how much may wait, how finished requests are decoded in step mode; and who
runs first, who pauses and who is refused (`engine.sched`)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BeforeValidator, Field

from engine.sched.priority import DEFAULT_AGING_S
from server.settings.section import MODEL_SECTION, Section
from server.settings.switches import AutoSwitch, Switch, switch_word


class BatchingSettings(Section):
    help_section = MODEL_SECTION
    each_model = True

    max_num_seqs: int = Field(8, ge=1, description="most images in one batched forward")
    request_batch_max_wait_ms: float = Field(
        0.0,
        ge=0,
        allow_inf_nan=False,
        description="how long an idle engine may wait for compatible requests (0 = never)",
    )
    max_queue_len: int = Field(1024, ge=1, description="most waiting requests; more get 429")
    max_queued_input_mb: float = Field(
        1024.0,
        gt=0,
        allow_inf_nan=False,
        description="most MiB of input images (edits, image-to-video) held by requests in progress; "
        "more get 429 (each image counts as stored: reduced to what the model uses)",
    )
    batching: Literal["request", "step"] = Field(
        "step",
        description="step: requests join and leave between denoising steps, each with its own "
        "steps, guidance and negative prompt (pipelines that cannot step fall back to request); "
        "request: same-key requests run as one batch to its end",
    )
    max_step_tokens: int | None = Field(
        None,
        ge=1,
        description="step mode: most rows x latent tokens stepping at once, so a large image or "
        "a video takes the share of several small images (default: max-num-seqs requests of the "
        "model's default size)",
    )
    mix_sizes: Annotated[Literal["on", "pad", "off"], BeforeValidator(switch_word)] = Field(
        "on",
        description="step mode: requests of different sizes step in one denoiser forward, in the "
        "families that can (the family table's 'sizes in one step'): packed end to end where the "
        "family packs, else padded to one token grid; pad: always the grid; off: one step group "
        "per size",
    )
    decode_overlap: AutoSwitch = Field(
        "off",
        description="step mode: decode finished requests on a second thread while the others go "
        "on stepping: on, off, or auto (when a decode is measured to cost more than a step); "
        "it shares the host's cores, so measure it with diffbatch bench before turning it on; "
        "not with --offload model or sequential",
    )


class SchedulingSettings(Section):
    """Who runs first and who waits. A request's own `priority` and its API key's default
    (`--api-key KEY:priority=N`, `server.api_keys`) say who runs first; aging says how long a
    worse priority may be passed over (`engine.sched.priority`). In step-level batching,
    worse-priority rows are held back from a step that would make a better-priority request
    miss its deadline (`engine.sched.step_groups`), and running requests pause for a waiting
    one of strictly better priority that cannot join, or for one of a key under its fair share
    (`engine.sched.preemption`). A request's deadline comes from `--request-timeout-s` (video
    jobs: `--video-timeout-s`) or its API key's SLO (`--api-key KEY:slo=SECONDS`); a deadline
    the work ahead would make it miss is refused at once (`engine.sched.deadline_admission`)."""

    help_section = MODEL_SECTION
    each_model = True

    deadline_groups: Switch = Field(
        "on",
        description="step-level batching: rows of worse priority step beside a request with a "
        "deadline (its timeout, or its API key's slo) only while the learnt step time keeps it "
        "on track; the others wait, with their state, until it finishes or has slack "
        "(off: every running request of the step key steps together)",
    )
    preemption: Switch = Field(
        "on",
        description="step-level batching: when a request of strictly better priority cannot join "
        "(max_num_seqs or max_step_tokens full), running requests of worse priority pause, "
        "keeping their state, and resume from the same step when room frees; so do running requests "
        "of a key over its fair share for a key under its own, at one priority (off: they run on)",
    )
    priority_aging_s: float = Field(
        DEFAULT_AGING_S,
        gt=0,
        allow_inf_nan=False,
        description="seconds of waiting that improve a request's priority by one level, so none "
        "starves: a request P levels worse waits behind better work for at most P times this",
    )
    deadline_admission: Switch = Field(
        "on",
        description="refuse at once (429 with Retry-After and the estimate) a request that the work "
        "ahead of it would make finish past its deadline, instead of running it late; estimated "
        "from the step times measured on finished work (none measured yet: admitted); off: "
        "every request is queued and one past its deadline gets 504",
    )

    @property
    def preempts(self) -> bool:
        return self.preemption == "on"
