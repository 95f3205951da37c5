"""A generation's conditioning images checked and decoded before it queues: each
`controlnet` entry names a ControlNet served with the request's model and its window is
0 <= start < end <= 1; each `ip_adapter` entry names an IP-Adapter served with it; every
image (a data URL or bare base64) decodes within the server's upload limits. Every error is
a 400 (413 for too many bytes) naming the entry's field, such as `controlnet[0].image` or
`ip_adapter[1].name`."""

from __future__ import annotations

from typing import Any

from engine.request import ControlRef, IPAdapterRef
from server.errors import APIError
from server.protocol import ImageGenerationRequest
from server.state import AppState
from server.uploads import read_data_url


async def read_controls(body: ImageGenerationRequest, state: AppState) -> tuple[ControlRef, ...]:
    if not body.controlnet:
        return ()
    served = state.models.base_of(body.model)
    served.check_controlnets([control.name for control in body.controlnet])
    controls = []
    for index, control in enumerate(body.controlnet):
        field = f"controlnet[{index}]"
        if not control.start < control.end:
            raise APIError(
                400,
                f"{field}: start ({control.start}) must be below end ({control.end})",
                param=f"{field}.end",
            )
        image = await _decoded(control.image, f"{field}.image", state)
        controls.append(ControlRef(control.name, image, control.scale, control.start, control.end))
    return tuple(controls)


async def read_ip_adapters(body: ImageGenerationRequest, state: AppState) -> tuple[IPAdapterRef, ...]:
    if not body.ip_adapter:
        return ()
    served = state.models.base_of(body.model)
    served.check_ip_adapters([ref.name for ref in body.ip_adapter])
    refs = []
    for index, ref in enumerate(body.ip_adapter):
        image = await _decoded(ref.image, f"ip_adapter[{index}].image", state)
        refs.append(IPAdapterRef(ref.name, image, ref.scale))
    return tuple(refs)


async def _decoded(image: str, param: str, state: AppState) -> Any:
    # Bare base64 is a PNG, JPEG or WebP all the same: the decoder reads the format.
    url = image if image.startswith("data:") else f"data:image/png;base64,{image}"
    max_bytes = int(state.settings.max_body_mb * 1024 * 1024)
    return await read_data_url(url, param, max_bytes, state.settings.max_upload_pixels)
