"""What running work reports back to the engine: each forward, decode and prepare
(`ForwardRecord`, `DecodeRecord`, `PrepareRecord`), each stage's fit in memory (`StageFit`),
and each request's outcome (`BatchOutput`). A leaf: the plain request types only, so the
scheduling policy, the worker side and the engine read the same records."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from engine.request import PartialImage, RequestOutput

Stage = Literal["prepare", "step", "finish"]


@dataclass(frozen=True, slots=True)
class StageFit:
    """One stage over a group of requests whose step costs add up to `cost`: it fitted in
    memory, or it ran out (other failures are not reported)."""

    stage: Stage
    cost: int
    out_of_memory: bool = False


@dataclass(frozen=True, slots=True)
class ForwardRecord:
    """One pipeline forward: how many requests and images it carried, how long it took, the
    LoRA adapter it ran with (None: the base model), how many denoising steps it took
    (a request-level forward all its requests' steps; a step-level forward one), and
    whether it ran while a decode ran beside it (`shared`: step-level, decode overlap; its
    time then includes some of the decode's work, which shares the device, so it is not
    taken as a step's cost), and how many graphs torch.compile compiled during it (after
    the warm-up at start: each one a recompile its requests waited for; the pipeline's
    `compiled_graphs()`)."""

    num_requests: int
    num_images: int
    seconds: float
    ok: bool
    interrupted: bool = False
    out_of_memory: bool = False
    adapter: str | None = None
    steps: int = 1
    shared: bool = False
    # Denoiser blocks its requests skipped under First-Block Cache (step mode).
    cache_blocks_skipped: int = 0
    # Distinct output sizes (and frame counts) among its requests: above 1, rows of
    # different sizes shared one forward (packed or padded, `Family.mixes_sizes_for`).
    sizes: int = 1
    compiles: int = 0
    # Which requests it carried, and the host's `time.monotonic()` when it was issued (a
    # request's timeline, `engine.timeline`).
    request_ids: tuple[str, ...] = ()
    started: float = 0.0


@dataclass(frozen=True, slots=True)
class DecodeRecord:
    """One VAE decode, in step-level batching, of requests that took their last step
    (request-level forwards decode inside the pipeline call): how many requests and images
    it decoded together, how long it took, and whether it ran beside the steps."""

    num_requests: int
    num_images: int
    seconds: float
    ok: bool
    beside: bool = False
    request_ids: tuple[str, ...] = ()
    started: float = 0.0  # the host's `time.monotonic()` when it was issued


@dataclass(frozen=True, slots=True)
class PrepareRecord:
    """One step-level prepare (prompts encoded, latents drawn) of requests that joined
    together, that ran to its end: when it was issued (`time.monotonic()`) and how long it
    took on the host."""

    request_ids: tuple[str, ...]
    started: float
    seconds: float


@dataclass(frozen=True, slots=True)
class ModerationRecord:
    """One check by the safety checker (`engine.worker.moderation`) of requests' final images
    (`image`) or of their previews (`preview`): how many it checked and how many it flagged
    (a request's images count as one: any flagged image flags them)."""

    stage: Literal["image", "preview"]
    checked: int
    flagged: int


@dataclass(slots=True)
class BatchOutput:
    """Each request of a batch ends here exactly once: in `outputs` or in `errors`.

    In step-level batching a request may end in neither (it has steps left); `progress`
    then says how far each request of the step group has got: (steps done, total),
    `partials` holds the previews (`partial_images`) made on the way, in order, and
    `decoding` the requests done denoising whose decode now runs beside the steps (their
    outputs come in a later result), `decodes` the decodes that ended in this result, and
    `prepares` the prepares that ran to their end in it.
    """

    outputs: dict[str, RequestOutput] = field(default_factory=dict)
    errors: dict[str, Exception] = field(default_factory=dict)
    forwards: list[ForwardRecord] = field(default_factory=list)
    progress: dict[str, tuple[int, int]] = field(default_factory=dict)
    partials: list[PartialImage] = field(default_factory=list)
    decoding: list[str] = field(default_factory=list)
    decodes: list[DecodeRecord] = field(default_factory=list)
    prepares: list[PrepareRecord] = field(default_factory=list)
    # Step-level batching: each stage over a group that fitted in memory or ran out of it.
    fits: list[StageFit] = field(default_factory=list)
    # VAE decodes that ran out of memory and were halved inside the VAE since the last
    # result (the pipeline's `decode_out_of_memory()`); they touch no cap or budget.
    decode_out_of_memory: int = 0
    # The worker's prompt-embedding cache, cumulative counts as of this result
    # (the pipeline's `prompt_cache_counts()`); None where the pipeline has none.
    prompt_cache: dict[str, float] | None = None
    # What the safety checker checked and flagged in this result.
    moderations: list[ModerationRecord] = field(default_factory=list)


def fitting_images(forwards: list[ForwardRecord]) -> int | None:
    """After a batch ran out of memory and was retried in halves: the most images one of
    its forwards held without running out (below the smallest that did), or half of the
    smallest failure; None if nothing ran out of memory."""
    failed = [f.num_images for f in forwards if f.out_of_memory]
    if not failed:
        return None
    smallest = min(failed)
    fitted = [f.num_images for f in forwards if f.ok and f.num_images < smallest]
    return max(fitted, default=smallest // 2) or 1
