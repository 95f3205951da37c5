"""`POST /v1/images/generations` and the files behind `response_format=url`."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import FileResponse, Response, StreamingResponse

from engine.request import GenerationRequest, RequestOutput
from server.errors import APIError
from server.media import MEDIA_TYPE, encode_image, image_size
from server.protocol import ImageGenerationRequest, ImageObject, ImagesResponse
from server.state import AppState, State, require_api_key, until_disconnected

router = APIRouter()
files_router = APIRouter()


@router.post("/v1/images/generations", dependencies=[Depends(require_api_key)])
async def create_images(body: ImageGenerationRequest, request: Request, state: State) -> Response:
    state.check_model(body.model)
    state.check_modality("image", "/v1/images/generations")
    output = await until_disconnected(request, state.engine.generate(to_generation_request(body, state)))
    return await image_response(body, output, request, state)


async def image_response(
    body: ImageGenerationRequest, output: RequestOutput, request: Request, state: AppState
) -> Response:
    """Encode (off the event loop) and answer as JSON, server-sent events, or URLs."""
    encoded = await asyncio.to_thread(_encode_all, output, body)
    if body.stream:
        return StreamingResponse(_completed_events(encoded, output, body), media_type="text/event-stream")
    data = []
    for image, seed in zip(encoded, output.seeds, strict=True):
        if body.response_format == "url":
            name = await asyncio.to_thread(state.image_store.save, image, body.output_format)
            data.append(
                ImageObject(url=f"{request.base_url}generated/{name}", revised_prompt=body.prompt, seed=seed)
            )
        else:
            data.append(ImageObject(b64_json=_b64(image), revised_prompt=body.prompt, seed=seed))
    payload = ImagesResponse(
        created=int(time.time()),
        data=data,
        output_format=body.output_format,
        size=image_size(output.images[0]),
    )
    return Response(payload.model_dump_json(exclude_none=True), media_type="application/json")


@files_router.get("/generated/{name}")
async def generated_file(name: str, state: State) -> FileResponse:
    path = state.image_store.path_for(name)
    if path is None:
        raise APIError(404, "no such image: it never existed or it has expired", code="not_found")
    return FileResponse(path, media_type=MEDIA_TYPE[path.suffix.lstrip(".")])


def to_generation_request(
    body: ImageGenerationRequest, state: AppState, input_images: tuple[Any, ...] = (), mask: Any = None
) -> GenerationRequest:
    params = body.sampling_params(true_cfg_scale=body.true_cfg_scale, n=body.n, strength=body.strength)
    return GenerationRequest.create(
        body.prompt, params, timeout_s=state.settings.request_timeout_s, input_images=input_images, mask=mask
    )


def _encode_all(output: RequestOutput, body: ImageGenerationRequest) -> list[bytes]:
    return [encode_image(image, body.output_format, body.output_compression) for image in output.images]


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


async def _completed_events(
    encoded: list[bytes], output: RequestOutput, body: ImageGenerationRequest
) -> AsyncIterator[str]:
    """One `image_generation.completed` server-sent event per image (no partial previews yet)."""
    for image, seed, array in zip(encoded, output.seeds, output.images, strict=True):
        event = {
            "type": "image_generation.completed",
            "b64_json": _b64(image),
            "created_at": int(time.time()),
            "output_format": body.output_format,
            "size": image_size(array),
            "quality": body.quality or "auto",
            "background": body.background or "auto",
            "seed": seed,
        }
        yield f"event: image_generation.completed\ndata: {json.dumps(event)}\n\n"
