"""`POST /v1/images/variations`: OpenAI's variations, a multipart form with one image, drawn by
image-to-image of that image with no prompt at `VARIATION_STRENGTH` (a `strength` field
overrides it). So a variation is an edit the route fills in: it batches with edits and other
variations by the same keys, step by step, and a model that does no image-to-image refuses it
by `model`. Redux and IP-Adapter backed variations are a later step (issue 44)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from starlette.datastructures import UploadFile

from server.errors import ERROR_RESPONSES, UNSUPPORTED_FIELD, APIError
from server.image_answer import answer, prepared, to_generation_request
from server.image_form import form_body, require_multipart
from server.protocol import ImagesResponse, ImageVariationRequest
from server.request_log import received
from server.state import State, require_api_key
from server.uploads import pixels_digest, read_image, single_part

router = APIRouter(responses=ERROR_RESPONSES)
ENDPOINT = "/v1/images/variations"


@router.post(
    ENDPOINT,
    dependencies=[Depends(require_api_key)],
    responses={200: {"model": ImagesResponse, "description": "the images as JSON"}},
)
async def create_variations(request: Request, state: State) -> Response:
    require_multipart(request, "send the variation as multipart/form-data with the image file in 'image'")
    max_bytes, max_pixels = int(state.settings.max_body_mb * 1024 * 1024), state.settings.max_upload_pixels
    # Two files at most, so a repeated image is refused by name rather than by the parser.
    async with request.form(max_files=2) as form:
        body = form_body(form, ImageVariationRequest, ("image",))
        received(request, body.model, ENDPOINT)
        upload = single_part(form, "image")
        state.check_accepting()
        state.check_endpoint(body.model, "edit", ENDPOINT)
        if not isinstance(upload, UploadFile):
            raise APIError(400, "image is required: upload the image to vary as 'image'", param="image")
        with state.tracing.span("input decode", {"diffbatch.input_images": 1}):
            image = await read_image(upload, "image", max_bytes=max_bytes, max_pixels=max_pixels)
    generation = to_generation_request(body, request, state, input_images=(image,))
    load = prepared(state, body.model, generation, ENDPOINT)
    try:
        return await answer(
            body,
            request,
            state,
            load,
            kind="image_variation",
            deadline=generation.deadline,
            uploads=pixels_digest(image),
        )
    except APIError as exc:
        if exc.code == UNSUPPORTED_FIELD and exc.param == "strength":
            raise _no_image_to_image(body.model) from None
        raise


def _no_image_to_image(model: str | None) -> APIError:
    """The model takes images (an edit model) but not a `strength`: it does no image-to-image,
    the only way this server draws a variation."""
    name = "the model this server serves" if model is None else f"the model {model!r}"
    return APIError(
        400,
        f"{name} does not do image-to-image, which /v1/images/variations uses (the image redrawn "
        "with no prompt); serve an image-to-image model (docs/api.md, 'Image variations') or "
        "send the image and a prompt to /v1/images/edits",
        param="model",
        code="unsupported_model",
    )
