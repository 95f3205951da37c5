"""A generation's `controlnet` entries checked and decoded before it queues: each names a
ControlNet served with the request's model, its window is 0 <= start < end <= 1, and its
image (a data URL or bare base64) decodes within the server's upload limits. Every error is
a 400 (413 for too many bytes) naming the entry's field, such as `controlnet[0].image`."""

from __future__ import annotations

from engine.request import ControlRef
from server.errors import APIError
from server.protocol import ImageGenerationRequest
from server.state import AppState
from server.uploads import read_data_url


async def read_controls(body: ImageGenerationRequest, state: AppState) -> tuple[ControlRef, ...]:
    if not body.controlnet:
        return ()
    served = state.models.base_of(body.model)
    served.check_controlnets([control.name for control in body.controlnet])
    max_bytes = int(state.settings.max_body_mb * 1024 * 1024)
    max_pixels = state.settings.max_upload_pixels
    controls = []
    for index, control in enumerate(body.controlnet):
        field = f"controlnet[{index}]"
        if not control.start < control.end:
            raise APIError(
                400,
                f"{field}: start ({control.start}) must be below end ({control.end})",
                param=f"{field}.end",
            )
        # Bare base64 is a PNG, JPEG or WebP all the same: the decoder reads the format.
        url = control.image if control.image.startswith("data:") else f"data:image/png;base64,{control.image}"
        image = await read_data_url(url, f"{field}.image", max_bytes, max_pixels)
        controls.append(ControlRef(control.name, image, control.scale, control.start, control.end))
    return tuple(controls)
