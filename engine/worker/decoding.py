"""Where step-level batching decodes its finished requests: on the stepping thread, or on a
thread of its own while the others go on stepping.

A VAE decode on the stepping thread stalls every other running request for as long as it
takes. Decoding beside the steps removes the stall but shares the host's cores (and, on
a GPU, the default stream) with them. Measured on the 2-core development machine
(docs/benchmarks.md, "Decoding beside the steps"): in-process, without HTTP
(`python -m bench.decode_overlap`), it gives 1.21-1.31x images/s on decode-bound tiny
Qwen-Image and 0.95x on tiny-sd; in the whole server, whose event loop and PNG encoding
need those same two cores, 0.89-0.91x on tiny Qwen-Image. So `off` is the default, and
`auto` (decode beside when the decode about to start is expected to take longer than a
step, from what was measured) and `on` are there for hosts with cores to spare, or an
accelerator, to measure with `diffbatch bench`.

Pure: no threads, no clock, no torch; the runner reports what it timed.
"""

from __future__ import annotations

from typing import Literal

DecodeOverlap = Literal["auto", "on", "off"]
DECODE_OVERLAP_CHOICES: tuple[DecodeOverlap, ...] = ("auto", "on", "off")

# Weight of the newest measurement in the running means: recent enough to follow a change
# of workload, smooth enough that one slow step does not flip the decision.
_NEWEST = 0.2


class OverlapPolicy:
    """Whether the next decode runs beside the steps (True) or on the stepping thread."""

    def __init__(self, mode: DecodeOverlap = "auto") -> None:
        if mode not in DECODE_OVERLAP_CHOICES:
            raise ValueError(
                f"decode_overlap must be one of {', '.join(DECODE_OVERLAP_CHOICES)}, got {mode!r}"
            )
        self.mode = mode
        self.step_s: float | None = None
        self.decode_s_per_image: float | None = None

    def observe_step(self, seconds: float) -> None:
        self.step_s = _mean(self.step_s, seconds)

    def observe_decode(self, images: int, seconds: float) -> None:
        if images > 0:
            self.decode_s_per_image = _mean(self.decode_s_per_image, seconds / images)

    def worth_waiting(self, steps: int) -> bool:
        """Whether requests done denoising should wait `steps` more steps for the others of
        their group to finish and be decoded with them: when those steps are expected to
        take less than decoding one image would. On a decode-bound model a straggler decoded
        alone stalls everyone for a whole decode; on a denoiser-bound one waiting costs more
        than it saves. Unknown until a step and a decode have been timed."""
        if self.step_s is None or self.decode_s_per_image is None:
            return False
        return steps * self.step_s <= self.decode_s_per_image

    def overlap(self, images: int) -> bool:
        if self.mode != "auto":
            return self.mode == "on"
        if self.step_s is None or self.decode_s_per_image is None:
            return False  # decode once on the stepping thread to learn what it costs
        return self.decode_s_per_image * images > self.step_s


def _mean(current: float | None, newest: float) -> float:
    return newest if current is None else (1 - _NEWEST) * current + _NEWEST * newest
