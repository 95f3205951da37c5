"""`POST /v1/images/edits`: a multipart form with the input image(s), an optional mask, the
same fields as generations, and ControlNet and IP-Adapter entries (`server.control_form`).
Uploads are checked before anything is queued."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from starlette.datastructures import UploadFile

from engine.request import MAX_CONTROLNETS, MAX_IP_ADAPTERS
from server.control_form import form_controls, form_ip_adapters
from server.control_images import (
    controls_digest,
    ip_adapters_digest,
    read_control_entries,
    read_ip_adapter_entries,
)
from server.errors import ERROR_RESPONSES, IMAGE_RESPONSES, APIError
from server.idempotency import fingerprint
from server.image_answer import answer, prepared, to_generation_request
from server.image_form import form_body, require_multipart
from server.protocol import ImageEditRequest
from server.request_log import received
from server.state import State, require_api_key
from server.uploads import pixels_digest, read_image, single_part

router = APIRouter(responses=ERROR_RESPONSES)
ENDPOINT = "/v1/images/edits"

# Most images one edit request may upload: the model says how many it takes (Qwen-Image-Edit-
# Plus up to 3, FLUX.2 [dev] up to 6); 10 is the most any FLUX.2 takes (Black Forest Labs'
# playground), a bound on the upload only.
MAX_INPUT_IMAGES = 10
_FILE_FIELDS = ("image", "image[]", "mask")


@router.post("/v1/images/edits", dependencies=[Depends(require_api_key)], responses=IMAGE_RESPONSES)
async def edit_images(request: Request, state: State) -> Response:
    require_multipart(request, "send the edit as multipart/form-data with the image file(s) in 'image'")
    max_bytes, max_pixels = int(state.settings.max_body_mb * 1024 * 1024), state.settings.max_upload_pixels
    async with request.form(max_files=MAX_INPUT_IMAGES + 2 + MAX_CONTROLNETS + MAX_IP_ADAPTERS) as form:
        if form.get("markup") is not None:
            raise APIError(
                400,
                "markup (a guide overlay) is not supported: mark the area to edit with a mask",
                param="markup",
            )
        uploads = [u for u in (*form.getlist("image"), *form.getlist("image[]")) if isinstance(u, UploadFile)]
        parsed, parsed_refs = form_controls(form), form_ip_adapters(form)
        body = form_body(form, ImageEditRequest, _FILE_FIELDS + parsed.keys + parsed_refs.keys)
        received(request, body.model, ENDPOINT)
        mask_upload = single_part(form, "mask")
        state.check_accepting()
        state.check_endpoint(body.model, "edit", ENDPOINT)
        if not uploads:
            raise APIError(
                400, "image is required: upload the image to edit as 'image' (or 'image[]')", param="image"
            )
        if len(uploads) > MAX_INPUT_IMAGES:
            raise APIError(400, f"at most {MAX_INPUT_IMAGES} images per edit", param="image")
        with state.tracing.span("input decode", {"diffbatch.input_images": len(uploads)}):
            images = tuple(
                [await read_image(u, "image", max_bytes=max_bytes, max_pixels=max_pixels) for u in uploads]
            )
            mask = None
            if isinstance(mask_upload, UploadFile):
                mask = await read_image(
                    mask_upload, "mask", max_bytes=max_bytes, max_pixels=max_pixels, mode="mask"
                )
            controls = await read_control_entries(body.model, parsed.entries, state)
            references = await read_ip_adapter_entries(body.model, parsed_refs.entries, state)
        if mask is not None and mask.shape[:2] != images[0].shape[:2]:
            raise APIError(
                400,
                f"mask is {mask.shape[1]}x{mask.shape[0]} but the image is "
                f"{images[0].shape[1]}x{images[0].shape[0]}: they must be the same size",
                param="mask",
            )
    # The uploads as the pixels they decoded to: a multipart body's bytes differ on every
    # retry (the client draws a new boundary).
    masks = () if mask is None else (mask,)
    pixels = fingerprint(
        pixels_digest(*images),
        pixels_digest(*masks),
        *controls_digest(controls),
        *ip_adapters_digest(references),
    )
    generation = to_generation_request(
        body, request, state, input_images=images, mask=mask, controls=controls, ip_adapters=references
    )
    load = prepared(state, body.model, generation, ENDPOINT)
    return await answer(
        body, request, state, load, kind="image_edit", deadline=generation.deadline, uploads=pixels
    )
