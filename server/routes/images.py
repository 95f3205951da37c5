"""`POST /v1/images/generations` and the files behind `response_format=url`."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from engine.core.service import EngineService
from engine.request import GenerationRequest
from server.control_images import read_controls, read_ip_adapters
from server.errors import ERROR_RESPONSES, IMAGE_RESPONSES, APIError
from server.image_answer import answer, to_generation_request
from server.media import MEDIA_TYPE
from server.protocol import ImageGenerationRequest
from server.request_log import received
from server.state import State, require_api_key, require_json

router = APIRouter(responses=ERROR_RESPONSES)
ENDPOINT = "/v1/images/generations"

files_router = APIRouter(responses=ERROR_RESPONSES)


@router.post(
    "/v1/images/generations",
    dependencies=[Depends(require_api_key), Depends(require_json)],
    responses=IMAGE_RESPONSES,
)
async def create_images(body: ImageGenerationRequest, request: Request, state: State) -> Response:
    received(request, body.model, ENDPOINT)
    state.check_accepting()
    state.check_endpoint(body.model, "image", ENDPOINT)
    controls = await read_controls(body, state)
    references = await read_ip_adapters(body, state)
    generation = to_generation_request(body, request, state, controls=controls, ip_adapters=references)

    async def load() -> tuple[EngineService, GenerationRequest]:
        return await state.engine_for(body.model, "image", ENDPOINT, generation.deadline), generation

    return await answer(body, request, state, load, kind="image_generation", deadline=generation.deadline)


@files_router.get(
    "/generated/{name}",
    response_class=Response,
    responses={200: {"content": {media: {} for media in MEDIA_TYPE.values()}}},
)
async def generated_file(name: str, state: State) -> Response:
    content = await asyncio.to_thread(state.image_store.response, name)
    if content is None:
        raise APIError(404, "no such image: it never existed or it has expired", code="not_found")
    return content
