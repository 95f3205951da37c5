"""A request's conditioning images checked and decoded before it queues: each `controlnet`
entry names a ControlNet served with the request's model and its window is
0 <= start < end <= 1; each `ip_adapter` entry names an IP-Adapter served with it; every
image (a data URL or bare base64, or an edit form's file part) decodes within the server's
upload limits. Every error is a 400 (413 for too many bytes) naming the entry's field, such as
`controlnet[0].image` or `ip_adapter[1].name`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from starlette.datastructures import UploadFile

from engine.request import ControlRef, IPAdapterRef
from server.errors import APIError
from server.protocol import ControlSettings, ImageGenerationRequest, IPAdapterSettings
from server.state import AppState
from server.uploads import pixels_digest, read_data_url, read_image

# A `controlnet` entry's settings with its image: inline text, or an edit form's file part.
ControlEntry = tuple[ControlSettings, str | UploadFile]
# An `ip_adapter` entry's settings with its reference image, likewise.
IPAdapterEntry = tuple[IPAdapterSettings, str | UploadFile]


async def read_controls(body: ImageGenerationRequest, state: AppState) -> tuple[ControlRef, ...]:
    """A JSON body's `controlnet` entries."""
    entries = [(control, control.image) for control in body.controlnet or ()]
    return await read_control_entries(body.model, entries, state)


async def read_control_entries(
    model: str | None, entries: Sequence[ControlEntry], state: AppState
) -> tuple[ControlRef, ...]:
    if not entries:
        return ()
    served = state.models.base_of(model)
    served.check_controlnets([control.name for control, _ in entries])
    controls = []
    for index, (control, image) in enumerate(entries):
        field = f"controlnet[{index}]"
        if not control.start < control.end:
            raise APIError(
                400,
                f"{field}: start ({control.start}) must be below end ({control.end})",
                param=f"{field}.end",
            )
        pixels = await _decoded(image, f"{field}.image", state)
        controls.append(
            ControlRef(control.name, pixels, control.scale, control.start, control.end, control.mode)
        )
    return tuple(controls)


def controls_digest(controls: tuple[ControlRef, ...]) -> tuple[str, ...]:
    """What tells an edit's controls apart in the keys that compare requests (idempotency,
    the result cache), where they are not part of the body: their settings and pixels."""
    if not controls:
        return ()  # an edit without control keeps the key it had
    # A mode only where given, so an edit's key without one is the key it had.
    settings = [
        f"{c.name} {c.scale!r} {c.start!r} {c.end!r}" + ("" if c.mode is None else f" {c.mode}")
        for c in controls
    ]
    return (*settings, pixels_digest(*(c.image for c in controls)))


async def read_ip_adapters(body: ImageGenerationRequest, state: AppState) -> tuple[IPAdapterRef, ...]:
    """A JSON body's `ip_adapter` entries."""
    entries = [(ref, ref.image) for ref in body.ip_adapter or ()]
    return await read_ip_adapter_entries(body.model, entries, state)


async def read_ip_adapter_entries(
    model: str | None, entries: Sequence[IPAdapterEntry], state: AppState
) -> tuple[IPAdapterRef, ...]:
    if not entries:
        return ()
    served = state.models.base_of(model)
    served.check_ip_adapters([ref.name for ref, _ in entries])
    refs = []
    for index, (ref, image) in enumerate(entries):
        pixels = await _decoded(image, f"ip_adapter[{index}].image", state)
        refs.append(IPAdapterRef(ref.name, pixels, ref.scale))
    return tuple(refs)


def ip_adapters_digest(refs: tuple[IPAdapterRef, ...]) -> tuple[str, ...]:
    """What tells an edit's reference images apart in the keys that compare requests, as
    `controls_digest` for control images."""
    if not refs:
        return ()  # an edit without one keeps the key it had
    settings = [f"{r.name} {r.scale!r}" for r in refs]
    return (*settings, pixels_digest(*(r.image for r in refs)))


async def _decoded(image: str | UploadFile, param: str, state: AppState) -> Any:
    max_bytes, max_pixels = int(state.settings.max_body_mb * 1024 * 1024), state.settings.max_upload_pixels
    if isinstance(image, UploadFile):
        return await read_image(image, param, max_bytes=max_bytes, max_pixels=max_pixels)
    # Bare base64 is a PNG, JPEG or WebP all the same: the decoder reads the format.
    url = image if image.startswith("data:") else f"data:image/png;base64,{image}"
    return await read_data_url(url, param, max_bytes, max_pixels)
