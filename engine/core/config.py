"""Engine settings: how requests are queued and batched."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from engine.sched.priority import DEFAULT_AGING_S, check_aging_s

Batching = Literal["request", "step"]


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """`max_num_seqs`: most images in one forward (a request counts its n).
    `request_batch_max_wait_ms`: how long an idle engine may wait for compatible arrivals
    before running a batch that is not full (0 = never wait).
    `max_queue_len`: most requests waiting; beyond it new requests are refused (429).
    `batching`: "request" runs each batch of same-key requests to its end; "step" lets
    requests join and leave between denoising steps (pipelines that support it).
    `max_input_bytes`: most bytes of input images (edits, image-to-video) held by requests
    in the engine at once; beyond it new ones are refused (429). None = no bound.
    `retry_on_worker_crash`: a request whose worker process died runs once more (on another
    worker if there is one) instead of failing with 503.
    `max_step_tokens`: in step mode, most rows x latent tokens running at once
    (`Pipeline.step_cost`); None = `max_num_seqs` requests of the model's default shape.
    `max_loras`: in step mode, most distinct LoRA adapters running at once (the number the
    pipeline keeps loaded); None = no bound.
    `priority_aging_s`: seconds of waiting that improve a request's priority by one level
    (`engine.sched.priority`), so no priority starves.
    `deadline_admission`: refuse at once (429) a request whose deadline the work ahead of it
    would make it miss (`engine.sched.deadline_admission`), instead of running it late.
    `preemption`: in step mode, running requests pause for a waiting one of strictly better
    priority that does not fit (`engine.sched.preemption`); request mode never preempts.
    `deadline_groups`: in step mode, worse-priority rows step beside requests with a deadline
    only while the learnt step time keeps those on track (`engine.sched.step_groups`).
    """

    max_num_seqs: int = 8
    request_batch_max_wait_ms: float = 0.0
    max_queue_len: int = 1024
    batching: Batching = "request"
    max_step_tokens: int | None = None
    max_input_bytes: int | None = None
    retry_on_worker_crash: bool = False
    max_loras: int | None = None
    priority_aging_s: float = DEFAULT_AGING_S
    deadline_admission: bool = True
    preemption: bool = True
    deadline_groups: bool = True

    def __post_init__(self) -> None:
        if (
            isinstance(self.max_num_seqs, bool)
            or not isinstance(self.max_num_seqs, int)
            or self.max_num_seqs < 1
        ):
            raise ValueError(f"max_num_seqs must be an integer >= 1, got {self.max_num_seqs!r}")
        wait = self.request_batch_max_wait_ms
        if isinstance(wait, bool) or not isinstance(wait, int | float) or not math.isfinite(wait) or wait < 0:
            raise ValueError(f"request_batch_max_wait_ms must be a finite number >= 0, got {wait!r}")
        if (
            isinstance(self.max_queue_len, bool)
            or not isinstance(self.max_queue_len, int)
            or self.max_queue_len < 1
        ):
            raise ValueError(f"max_queue_len must be an integer >= 1, got {self.max_queue_len!r}")
        tokens = self.max_step_tokens
        if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1):
            raise ValueError(f"max_step_tokens must be an integer >= 1, got {tokens!r}")
        loras = self.max_loras
        if loras is not None and (isinstance(loras, bool) or not isinstance(loras, int) or loras < 1):
            raise ValueError(f"max_loras must be an integer >= 1, got {loras!r}")
        check_aging_s(self.priority_aging_s)
        if self.batching not in ("request", "step"):
            raise ValueError(f"batching must be 'request' or 'step', got {self.batching!r}")
