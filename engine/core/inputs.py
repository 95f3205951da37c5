"""Input images (edits, image-to-video) while their requests are in the engine.

`prepared_inputs` runs off the event loop before admission: the pipeline reduces the
images to what it will use of them, and they are digested once, for batch keys that must
tell images apart. `InputLedger` counts the bytes that requests in progress hold, so a
queue of large uploads is bounded in memory, not only in length.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from engine.errors import QueueFullError
from engine.request import GenerationRequest, InvalidRequestError

if TYPE_CHECKING:
    from engine.spec import PipelineSpec


def prepared_inputs(spec: PipelineSpec, request: GenerationRequest) -> GenerationRequest:
    """`request` with its input images reduced (`Pipeline.reduce_inputs`) and digested."""
    try:
        reduced = spec.reduce_inputs(request.with_params(spec.resolve(request)))
    except InvalidRequestError:
        return request  # admission says what is wrong with it
    digest = hashlib.sha256()
    references = (ref.image for ref in reduced.ip_adapters)
    for image in (*reduced.input_images, *(control.image for control in reduced.controls), *references):
        digest.update(repr(getattr(image, "shape", None)).encode())
        try:
            digest.update(memoryview(image))  # no copy for a contiguous array
        except (BufferError, TypeError, ValueError):
            digest.update(image.tobytes())
    return replace(reduced, input_digest=digest.hexdigest())


class InputLedger:
    """Bytes of input images held by requests in progress, bounded by `max_bytes` (None: no
    bound). A request alone may exceed the bound, so no single request is refused forever."""

    def __init__(self, max_bytes: int | None) -> None:
        self.max_bytes = max_bytes
        self.total = 0
        self._held: dict[str, int] = {}

    def hold(self, request: GenerationRequest, max_queue_len: int, retry_after: Callable[[], float]) -> None:
        """Count `request`'s inputs, or raise `QueueFullError` (429, `retry_after()` seconds
        to wait: estimated only when refusing) if they do not fit."""
        size, limit = request.input_bytes, self.max_bytes
        if not size:
            return
        if limit is not None and self.total + size > limit and self.total > 0:
            retry_after_s = retry_after()
            raise QueueFullError(
                max_queue_len,
                retry_after_s,
                f"requests in progress already hold {self.total / 2**20:.1f} MiB of input images and "
                f"this one {size / 2**20:.1f} MiB, over this server's limit of {limit / 2**20:.1f} MiB; "
                f"retry after {retry_after_s:.0f} s",
            )
        self._held[request.request_id] = size
        self.total += size

    def release(self, request_id: str) -> None:
        self.total -= self._held.pop(request_id, 0)
