"""Image streams (`stream: true`): OpenAI's server-sent events for one request.

`<kind>.partial_image` for each preview (`partial_images`, made while the request denoises
in step-level batching), then `<kind>.completed` for each image; `kind` is
`image_generation` or `image_edit`, as OpenAI names them per endpoint. A keep-alive
comment goes out whenever nothing else has for `KEEPALIVE_S`, so proxies keep a long
generation's connection open. A failure after the stream has started (the status line is
sent) arrives as an `error` event with the usual error object, which the official client
raises. Closing the connection aborts the request.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi.responses import StreamingResponse
from fastapi.sse import KEEPALIVE_COMMENT, format_sse_event

from engine.core.handle import RequestHandle
from engine.request import PartialImage, RequestOutput
from server.b64_json import fill_b64
from server.encoding_pool import EncodingPool
from server.errors import from_engine_error
from server.media import encode_image, image_size
from server.protocol import ErrorBody, ImageGenerationRequest
from server.tracing.tracing import TRACING_OFF, Tracing

logger = logging.getLogger(__name__)

# Seconds without an event before a keep-alive comment (FastAPI's own SSE interval).
KEEPALIVE_S = 15.0


def image_stream(
    body: ImageGenerationRequest,
    handle: RequestHandle,
    kind: str,
    encoder: EncodingPool,
    tracing: Tracing = TRACING_OFF,
) -> StreamingResponse:
    """The request's events; its images encoded in `encoder`."""
    # No-cache and no proxy buffering, as FastAPI's own event streams send.
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    events = _events(body, handle, kind, encoder, tracing)
    return StreamingResponse(events, media_type="text/event-stream", headers=headers)


async def _events(
    body: ImageGenerationRequest, handle: RequestHandle, kind: str, encoder: EncodingPool, tracing: Tracing
) -> AsyncIterator[bytes]:
    try:
        async with aclosing(handle.events(heartbeat_s=KEEPALIVE_S)) as events:
            async for event in events:
                if event is None:
                    yield KEEPALIVE_COMMENT
                elif isinstance(event, PartialImage):
                    for frame in await encoder.run(_partial_frames, body, event, kind):
                        yield frame
                else:
                    with tracing.span("encode", {"diffbatch.images": len(event.images)}):
                        frames = await encoder.run(_completed_frames, body, event, kind)
                    for frame in frames:
                        yield frame
    except Exception as exc:  # noqa: BLE001 - the status is sent: the error becomes an event
        error = from_engine_error(exc, handle.request.params.lora, body.lora_param())
        logger.info("stream of request %s ended with %s: %s", handle.request_id, error.status, error.message)
        detail = ErrorBody(message=error.message, type=error.type, param=error.param, code=error.code)
        yield format_sse_event(
            data_str=json.dumps({"type": "error", "error": detail.model_dump()}), event="error"
        )


def _partial_frames(body: ImageGenerationRequest, partial: PartialImage, kind: str) -> list[bytes]:
    return [
        _frame(
            f"{kind}.partial_image",
            body,
            image,
            partial_image_index=partial.index,
            image_index=i,
        )
        for i, image in enumerate(partial.images)
    ]


def _completed_frames(body: ImageGenerationRequest, output: RequestOutput, kind: str) -> list[bytes]:
    return [
        _frame(f"{kind}.completed", body, image, image_index=i, seed=seed)
        for i, (image, seed) in enumerate(zip(output.images, output.seeds, strict=True))
    ]


def _frame(event_type: str, body: ImageGenerationRequest, image: Any, **fields: Any) -> bytes:
    data = encode_image(image, body.output_format, body.output_compression)
    event = {
        "type": event_type,
        "b64_json": "",  # filled with the image's base64 by `fill_b64`, which no serializer reads
        "created_at": int(time.time()),
        "output_format": body.output_format,
        "size": image_size(image),
        "quality": body.quality_tier() or "auto",
        "background": body.background or "auto",
        **fields,
    }
    # As `format_sse_event` writes one (a dump has no line breaks), with the image joined in.
    text = json.dumps(event, separators=(",", ":"))
    return b"".join((f"event: {event_type}\ndata: ".encode(), fill_b64(text, [data]), b"\n\n"))
