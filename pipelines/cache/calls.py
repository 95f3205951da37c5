"""Which denoiser forward of a step is running, for step mode's First-Block Cache.

Most families call their denoiser once per step with every row of the group; the cache then
needs to be told nothing. A family that calls it otherwise wraps each call in
`denoiser_call`: the rows of the step's batch it carries (Qwen-Image 2.1: one call per text
length; LTX-2: its perturbed and isolated passes), which pass it is (`kind`: each pass keeps
its own residuals per request), which expert (`phase`: Wan 2.2's two; a request's cache
starts again when it changes expert), and where the image tokens sit in the image stream
(`image_tokens`: Z-Image's rows are padded to the batch's longest caption after them).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass


@dataclass(frozen=True)
class DenoiserCall:
    # Rows of the step's merged batch, ascending (None: every row, in order).
    rows: tuple[int, ...] | None = None
    kind: Hashable = ""
    phase: Hashable = ""
    # A text length or other shape the call's rows share (Qwen-Image 2.1's), part of the key
    # under which a request's residuals are kept, so they always compare like with like.
    tokens: int | None = None
    # The image stream's first `image_tokens` tokens are the image; the rest is left out of
    # each request's residuals (None: all of it).
    image_tokens: int | None = None

    @property
    def key(self) -> tuple[Hashable, Hashable, int | None]:
        return (self.phase, self.kind, self.tokens)


WHOLE_STEP = DenoiserCall()
_CURRENT: ContextVar[DenoiserCall] = ContextVar("diffbatch_denoiser_call", default=WHOLE_STEP)


@contextmanager
def denoiser_call(
    rows: Sequence[int] | None = None,
    *,
    kind: Hashable = "",
    phase: Hashable = "",
    tokens: int | None = None,
    image_tokens: int | None = None,
) -> Iterator[None]:
    """The denoiser forward inside is this one (see the module's note)."""
    call = DenoiserCall(
        None if rows is None else tuple(int(row) for row in rows), kind, phase, tokens, image_tokens
    )
    token = _CURRENT.set(call)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def current_call() -> DenoiserCall:
    return _CURRENT.get()
