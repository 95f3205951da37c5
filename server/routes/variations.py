"""`POST /v1/images/variations`: OpenAI's variations, a multipart form with one image and no
prompt. How the image is varied depends on what the model is served with:

- with an IP-Adapter (`--ip-adapter`), steered by the image's CLIP embedding through the first
  one at `VARIATION_IP_ADAPTER_SCALE`: a text-to-image model draws anew from it (nothing of the
  image's pixels is kept, its subject and style are); an image-to-image model also redraws the
  image itself at `VARIATION_STRENGTH` (a `strength` field overrides it), the embedding pulling
  the redrawn part back to the image's subject;
- without, by image-to-image of the image at `VARIATION_STRENGTH`.

So a variation is a generation or an edit the route fills in: it batches with them and with
other variations by the same keys, step by step, and a model that can do neither refuses it
by `model`."""

from __future__ import annotations

from dataclasses import replace

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from starlette.datastructures import UploadFile

from engine.core.service import EngineService
from engine.request import GenerationRequest, IPAdapterRef
from server.errors import ERROR_RESPONSES, UNSUPPORTED_FIELD, APIError
from server.image_answer import Load, answer, prepared, to_generation_request
from server.image_form import form_body, require_multipart
from server.protocol import VARIATION_IP_ADAPTER_SCALE, ImagesResponse, ImageVariationRequest
from server.request_log import received
from server.state import AppState, State, require_api_key
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
        ip_adapters = state.models.base_of(body.model).ip_adapters
        state.check_endpoint(body.model, ("image", "edit") if ip_adapters else "edit", ENDPOINT)
        if not isinstance(upload, UploadFile):
            raise APIError(400, "image is required: upload the image to vary as 'image'", param="image")
        with state.tracing.span("input decode", {"diffbatch.input_images": 1}):
            image = await read_image(upload, "image", max_bytes=max_bytes, max_pixels=max_pixels)
    generation = to_generation_request(body, request, state, input_images=(image,))
    if ip_adapters:
        load = _steered(state, body, generation, ip_adapters[0])
    else:
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


def _steered(
    state: AppState, body: ImageVariationRequest, generation: GenerationRequest, ip_adapter: str
) -> Load:
    """How a variation steered by the IP-Adapter `ip_adapter` is loaded: the model's engine,
    then the request as the model's task takes it, its inputs reduced and digested."""
    sent_strength = "strength" in body.model_fields_set

    async def load() -> tuple[EngineService, GenerationRequest]:
        engine = await state.engine_for(body.model, ("image", "edit"), ENDPOINT, generation.deadline)
        text_to_image = engine.modality == "image"
        if text_to_image and sent_strength:
            raise APIError(
                400,
                "strength is for image-to-image: this model draws a variation anew from the image's "
                "embedding (its IP-Adapter), keeping none of its pixels; leave strength out",
                param="strength",
            )
        steered = _with_reference(generation, ip_adapter, text_to_image=text_to_image)
        with state.tracing.span("input prepare"):
            return engine, await engine.prepare_inputs(steered)

    return load


def _with_reference(
    generation: GenerationRequest, ip_adapter: str, *, text_to_image: bool
) -> GenerationRequest:
    """The variation with its image as the IP-Adapter's reference; for a text-to-image model,
    as its only input, with no strength."""
    (image,) = generation.input_images
    reference = (IPAdapterRef(ip_adapter, image, VARIATION_IP_ADAPTER_SCALE),)
    if not text_to_image:
        return replace(generation, ip_adapters=reference)
    params = replace(generation.params, strength=None)
    return replace(generation, input_images=(), ip_adapters=reference, params=params)


def _no_image_to_image(model: str | None) -> APIError:
    """The model takes images (an edit model) but not a `strength`: it does no image-to-image,
    the only way this server draws a variation without an IP-Adapter."""
    name = "the model this server serves" if model is None else f"the model {model!r}"
    return APIError(
        400,
        f"{name} does not do image-to-image, which /v1/images/variations uses (the image redrawn "
        "with no prompt); serve an image-to-image model, or a model with an IP-Adapter (docs/api.md, "
        "'Image variations'), or send the image and a prompt to /v1/images/edits",
        param="model",
        code="unsupported_model",
    )
