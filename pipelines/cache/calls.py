"""Which denoiser forward of a step is running, for step mode's First-Block Cache.

Most families call their denoiser once per step with every row of the group; the cache then
needs to be told nothing. A family that calls it otherwise wraps each call in
`denoiser_call`: the rows of the step's batch it carries (Qwen-Image 2.1: one call per text
length; LTX-2: its perturbed and isolated passes), which pass it is (`kind`: each pass keeps
its own residuals per request), which expert (`phase`: Wan 2.2's two; a request's cache
starts again when it changes expert), and where the image tokens sit in the image stream
(`image_tokens`: Z-Image's rows are padded to the batch's longest caption after them), and
which places of the image tokens are each row's own (`places`: rows of different sizes laid
on one grid, `pipelines.stepping.padded_grid`).

A lane of several devices wraps each member's forward in one too (`pipelines.parallel.
lane_split`): the rows of the step's batch the member runs, and `summed`, how the per-request
figures a decision reads are summed with the members that hold the request's other rows (its
other CFG branch) or tokens (their share of every row). A call inside another is taken
relative to it: its rows are rows of the outer call's, and what it does not say, it inherits.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

from torch import Tensor

# Sums a tensor of per-request figures, in place, over the devices that share the requests'
# rows or tokens (a lane's `all_reduce`), and returns it.
Summed = Callable[[Tensor], Tensor]


@dataclass(frozen=True, eq=False)
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
    # Each row's own places among the image tokens, in its packed order (None: all of them).
    places: tuple[Tensor, ...] | None = None
    # How per-request figures are summed over a lane's members (None: this device holds all).
    summed: Summed | None = None

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
    places: Sequence[Tensor] | None = None,
    summed: Summed | None = None,
) -> Iterator[None]:
    """The denoiser forward inside is this one (see the module's note), within the call
    around it, if any."""
    outer = _CURRENT.get()
    own = None if rows is None else tuple(int(row) for row in rows)
    if outer.rows is not None:
        own = outer.rows if own is None else tuple(outer.rows[row] for row in own)
    if places is None and outer.places is not None:
        places = outer.places if rows is None else [outer.places[int(row)] for row in rows]
    call = DenoiserCall(
        own,
        kind if kind != "" else outer.kind,
        phase if phase != "" else outer.phase,
        tokens if tokens is not None else outer.tokens,
        image_tokens if image_tokens is not None else outer.image_tokens,
        None if places is None else tuple(places),
        summed if summed is not None else outer.summed,
    )
    token = _CURRENT.set(call)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def current_call() -> DenoiserCall:
    return _CURRENT.get()
