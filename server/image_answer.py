"""How an image request (a generation or an edit) becomes its answer: the engine's request
built from the body, then run once per Idempotency-Key, looked up in the result cache, held
to its API key's limits, and answered as server-sent events or as JSON (base64 images or
URLs). The routes (`routes/images.py`, `routes/edits.py`) parse and call `answer`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from engine.core.service import EngineService
from engine.request import ControlRef, GenerationRequest, InvalidRequestError, IPAdapterRef, RequestOutput
from server.b64_json import fill_b64
from server.cross_site import public_base_url
from server.errors import APIError, from_engine_error
from server.idempotency import HEADER, fingerprint, idempotency_key, once_answer
from server.key_limits import tenant_of
from server.media import encode_image, image_size
from server.protocol import ImageGenerationRequest, ImageObject, ImagesResponse
from server.result_cache import CachedImages, result_cache_key
from server.state import (
    AppState,
    caller_key,
    caller_priority,
    caller_tenant,
    caller_timeout,
    request_id_of,
    until_disconnected,
)
from server.streaming import image_stream

# The model's engine (loaded if need be) and the request as that engine prepared it.
Load = Callable[[], Awaitable[tuple[EngineService, GenerationRequest]]]


async def answer(
    body: ImageGenerationRequest,
    request: Request,
    state: AppState,
    load: Load,
    *,
    kind: str,
    deadline: float | None,
    uploads: str = "",
) -> Response:
    """Run the request `load` prepares and answer as server-sent events (`kind`.* events) or
    as JSON; with an Idempotency-Key, a retry of the same request (the same body and uploads,
    `uploads` being their `pixels_digest`) gets the first's answer. The result cache is
    looked up before `load`: a hit neither loads its model nor evicts another (with several
    models)."""
    key = idempotency_key(request)
    if body.stream and key is not None:
        # Events cannot be replayed to a retry, and a half-read stream cannot be joined.
        raise APIError(
            400, f"{HEADER} is not supported with stream=true: a stream cannot be replayed", param=HEADER
        )
    sender = caller_key(request)
    cache_key = _result_cache_key(body, request, state, kind, uploads)
    if key is None and (hit := await _cached(state, cache_key)) is not None:
        await state.key_limits.charge(sender)  # a hit is still a request its key sent
        return _json(await _response(body, hit, request, state))
    # The key's limits before its model loads or its inputs are prepared: a key past them
    # makes no load, no eviction and no decode. Released once, when the request ends.
    release = await state.key_limits.admit(sender)
    if key is not None:
        try:
            answered = await _once(
                body,
                request,
                state,
                load,
                key=key,
                deadline=deadline,
                uploads=uploads,
                cache_key=cache_key,
                release=release,
            )
            return _json(answered)
        finally:
            release()  # a retry that joined the first run submitted nothing; the first has ended
    try:
        engine, generation = await load()
    except BaseException:
        release()
        raise
    if body.stream:
        # Submitted here, so a refusal is still an HTTP error, not an event (an engine in
        # another process answers after `submit`: `accepted`).
        handle = state.key_limits.submit(engine, generation, sender, release)
        try:
            await handle.accepted()  # at once in this process; one round trip across processes
        except BaseException:
            handle.abort()
            raise
        return image_stream(body, handle, kind, state.encoder, state.tracing)
    running = until_disconnected(request, state.key_limits.generate(engine, generation, sender, release))
    output = await _generate(body, generation, running)
    return _json(await image_response(body, output, request, state, cache_key=cache_key))


async def _once(
    body: ImageGenerationRequest,
    request: Request,
    state: AppState,
    load: Load,
    *,
    key: str,
    deadline: float | None,
    uploads: str,
    cache_key: str | None,
    release: Callable[[], None],
) -> str:
    """The answer of a request with an Idempotency-Key `key`: run once, its retries joining
    it. The key is checked before the result cache, so a reuse of the key with another body
    is a 409 even where the cache holds that body's images (the cache ignores some fields)."""

    async def run() -> str:
        if (hit := await _cached(state, cache_key)) is not None:
            return (await _response(body, hit, request, state)).decode()
        engine, generation = await load()
        # Not cut short when the client leaves: its retry (the reason for the key) joins this.
        running = state.key_limits.generate(engine, generation, caller_key(request), release)
        output = await _generate(body, generation, running)
        answer = await image_response(body, output, request, state, cache_key=cache_key)
        return answer.decode()  # the store keeps text

    window_s = state.settings.idempotency_window_s
    # How long the first run may take before a retry's claim on it goes stale: until its own
    # deadline (its key's SLO may exceed --request-timeout-s), else the window.
    run_s = window_s if deadline is None else max(1.0, deadline - time.monotonic())
    # The whole body: a retry that changed any field (its timeout, its user) is another request.
    # Uploads only where there are some: a generation's digest stays the body's alone, as a
    # key stored before uploads counted (a retry across an upgrade) was taken.
    request_digest = fingerprint(body.model_dump_json(), *((uploads,) if uploads else ()))
    store = state.video_service().store
    return await once_answer(store, key, request_digest, window_s=window_s, run_s=run_s, answer=run)


async def _cached(state: AppState, cache_key: str | None) -> CachedImages | None:
    """The result cache's entry for `cache_key` (None: not cacheable, or not there)."""
    if cache_key is None or state.result_cache is None:
        return None
    return await state.result_cache.get(cache_key)


async def _generate(
    body: ImageGenerationRequest, generation: GenerationRequest, running: Awaitable[RequestOutput]
) -> RequestOutput:
    try:
        return await running
    except InvalidRequestError as exc:  # said against the fields this body sent
        raise from_engine_error(exc, generation.params.lora, body.lora_param()) from None


def _json(body: str | bytes) -> Response:
    return Response(body, media_type="application/json")


def _result_cache_key(
    body: ImageGenerationRequest, request: Request, state: AppState, kind: str, uploads: str
) -> str | None:
    """The request's key in the result cache, where the cache is on (`result_cache_key`): in
    its tenant's part unless `--result-cache-scope global`."""
    if state.result_cache is None:
        return None
    tenant = caller_tenant(request) if state.settings.result_cache_scope == "tenant" else None
    return result_cache_key(body, kind, uploads, tenant)


async def image_response(
    body: ImageGenerationRequest,
    output: RequestOutput,
    request: Request,
    state: AppState,
    *,
    cache_key: str | None = None,
) -> bytes:
    """Encode (in the encoding pool, off the event loop); the JSON answer with base64 images
    or URLs. With a `cache_key`, the encoded images go into the result cache."""
    with state.tracing.span("encode", {"diffbatch.images": len(output.images)}):
        encoded = await state.encoder.run(_encode_all, output, body)
    result = CachedImages(tuple(encoded), tuple(output.seeds), image_size(output.images[0]))
    if cache_key is not None and state.result_cache is not None:
        await state.result_cache.put(cache_key, result)
    return await _response(body, result, request, state)


async def _response(
    body: ImageGenerationRequest, result: CachedImages, request: Request, state: AppState
) -> bytes:
    if body.response_format == "url":
        data = []
        for image, seed in zip(result.images, result.seeds, strict=True):
            data.append(ImageObject(url=await _saved(image, body.output_format, request, state), seed=seed))
        return _payload(body, result, data).model_dump_json(exclude_none=True).encode()
    # No revised_prompt: this server never rewrites a prompt (OpenAI sends one only then).
    # Each b64_json is left empty and filled with the image's base64 in the encoding pool.
    slots = [ImageObject(b64_json="", seed=seed) for seed in result.seeds]
    text = _payload(body, result, slots).model_dump_json(exclude_none=True)
    return await state.encoder.run(fill_b64, text, result.images)


def _payload(body: ImageGenerationRequest, result: CachedImages, data: list[ImageObject]) -> ImagesResponse:
    return ImagesResponse(
        created=int(time.time()),
        data=data,
        output_format=body.output_format,
        size=result.size,
        quality=body.quality_tier(),
    )


async def _saved(image: bytes, output_format: str, request: Request, state: AppState) -> str:
    """Store the image; its URL: a presigned one from a bucket, else this server's own."""
    store = state.image_store
    with state.tracing.span("upload", {"diffbatch.bytes": len(image)}):
        name = await asyncio.to_thread(store.save, image, output_format)
        link = await asyncio.to_thread(store.link, name)
    if link is not None:
        return link
    return f"{public_base_url(request, state.settings.public_url, state.allowed_hosts)}generated/{name}"


def prepared(state: AppState, model: str | None, generation: GenerationRequest, endpoint: str) -> Load:
    """How a request with uploads (an edit, a variation) is loaded: its model's engine, then
    its inputs reduced to what the model uses and digested (still the input's decode)."""

    async def load() -> tuple[EngineService, GenerationRequest]:
        engine = await state.engine_for(model, "edit", endpoint, generation.deadline)
        with state.tracing.span("input prepare"):
            return engine, await engine.prepare_inputs(generation)

    return load


def check_background(body: ImageGenerationRequest) -> None:
    """No served model draws an alpha channel: a transparent background is refused, not
    silently answered with an opaque image."""
    if body.background == "transparent":
        raise APIError(
            400,
            "background 'transparent' is not supported: this server's models make opaque images",
            param="background",
        )


def to_generation_request(
    body: ImageGenerationRequest,
    request: Request,
    state: AppState,
    input_images: tuple[Any, ...] = (),
    mask: Any = None,
    *,
    controls: tuple[ControlRef, ...] = (),
    ip_adapters: tuple[IPAdapterRef, ...] = (),
) -> GenerationRequest:
    check_background(body)
    body = body.model_copy(update={"priority": caller_priority(request, body.priority)})
    params = body.sampling_params(
        true_cfg_scale=body.true_cfg_scale,
        n=body.n,
        strength=body.strength,
        quality=body.quality_tier(),
        lora=state.models.lora_for(body.model, body.lora),
        # Previews exist only to be streamed.
        partial_images=body.partial_images if body.stream else 0,
        moderation=body.moderation or "auto",
    )
    return GenerationRequest.create(
        body.prompt,
        params,
        timeout_s=caller_timeout(request, state.settings.request_timeout_s, body.timeout),
        input_images=input_images,
        mask=mask,
        controls=controls,
        ip_adapters=ip_adapters,
        request_id=request_id_of(request),
        traceparent=state.tracing.traceparent(),
        **tenant_of(caller_key(request)),
    )


def _encode_all(output: RequestOutput, body: ImageGenerationRequest) -> list[bytes]:
    return [encode_image(image, body.output_format, body.output_compression) for image in output.images]
