"""Reading uploaded images: size limits, decoding, and errors that name the form field."""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
from typing import Any

import numpy as np
from PIL import Image, UnidentifiedImageError
from PIL.Image import core as pillow_core  # type: ignore[attr-defined]
from starlette.datastructures import FormData, UploadFile

from server.errors import APIError
from server.idempotency import fingerprint

# Pillow allocates image memory in 16 MiB blocks from the C heap, which keeps them after the
# image is gone: 30 decoded 4096x4096 uploads left ~700 MiB behind in a server's threads.
# Blocks of 64 MiB are mapped and unmapped whole, so a decoded upload's memory goes back to
# the system once it has been reduced (the same as PILLOW_BLOCK_SIZE=64m).
pillow_core.set_block_size(64 * 2**20)


async def read_image(
    upload: UploadFile, field: str, *, max_bytes: int, max_pixels: int, mode: str = "RGB"
) -> np.ndarray:
    """The upload as a uint8 array (HxWx3 for RGB; for `mode="mask"`, see `edit_mask`).

    Too many bytes or pixels is a 413 and an unreadable file a 400, both naming `field`;
    decoding runs off the event loop.
    """
    data = await upload.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise APIError(
            413,
            f"{field} is larger than this server's limit of {max_bytes} bytes",
            param=field,
            code="file_too_large",
        )
    return await asyncio.to_thread(_decode, data, field, max_pixels, mode)


# What the error message promises; anything else (GIF, TIFF, BMP, ICO, ...) is refused.
FORMATS = ("PNG", "JPEG", "WEBP")
# 8-bit modes only: a 16-bit PNG ("I;16") would be cut to 8 bits by a blind conversion.
_MODES = ("1", "L", "LA", "P", "RGB", "RGBA", "CMYK", "YCbCr")


def no_files_api(field: str) -> APIError:
    """A `file_id` names an upload to OpenAI's Files API, which this server does not have."""
    return APIError(400, f"{field}: this server has no Files API; send the image itself", param=field)


def single_part(form: FormData, field: str, *aliases: str) -> Any:
    """The one value of a form part that may come once, under `field` or one of `aliases`
    (None if absent); 400 naming `field` if repeated, as for text fields (`form_fields`):
    silently keeping the last of two files would answer a question nobody asked."""
    values = [value for name in (field, *aliases) for value in form.getlist(name)]
    if len(values) > 1:
        raise APIError(400, f"{field} is given more than once; send it once", param=field)
    return values[0] if values else None


async def read_data_url(value: Any, field: str, max_bytes: int, max_pixels: int) -> np.ndarray:
    """An image given inline: a `data:image/...;base64,` URL, or `{"image_url": <that>}` as
    OpenAI's Videos API allows. Other URLs are refused: the server never fetches a URL a
    client names (it could reach what only the server can)."""
    if isinstance(value, dict):
        if "file_id" in value:
            raise no_files_api(field)
        value = value.get("image_url")
    if not isinstance(value, str) or not value.startswith("data:"):
        raise APIError(
            400,
            f"{field} must be an uploaded file or a data URL (data:image/png;base64,...); "
            "this server does not fetch URLs",
            param=field,
        )
    header, _, payload = value.partition(",")
    if not header.endswith(";base64"):
        raise APIError(400, f"{field}: a data URL must be base64 (data:image/png;base64,...)", param=field)
    if len(payload) * 3 // 4 > max_bytes:
        raise APIError(
            413,
            f"{field} is larger than this server's limit of {max_bytes} bytes",
            param=field,
            code="file_too_large",
        )
    try:
        data = base64.b64decode(payload, validate=True)
    except binascii.Error:
        raise APIError(400, f"{field}: the data URL is not valid base64", param=field) from None
    return await asyncio.to_thread(_decode, data, field, max_pixels, "RGB")


def pixels_digest(*arrays: np.ndarray) -> str:
    """A digest of decoded uploads as the pixels they are, for the keys that compare requests
    (idempotency, the result cache): each one's shape and dtype with its bytes, so uploads with
    the same bytes in another shape (8x4 or 4x8) or mode (a mask's HxW, an image's HxWx3)
    never share one."""
    return fingerprint(*(part for a in arrays for part in (f"{a.shape} {a.dtype}", a.tobytes())))


def edit_mask(image: Image.Image, field: str = "mask") -> np.ndarray:
    """OpenAI's mask as diffusers wants it, converted here and nowhere else: OpenAI marks the
    area to edit with fully transparent pixels (alpha 0) of an image with an alpha channel;
    diffusers' inpainting repaints where the mask is white. Returns HxW uint8, 255 = edit."""
    has_alpha = image.mode in ("LA", "RGBA") or (image.mode == "P" and "transparency" in image.info)
    if not has_alpha:
        raise APIError(
            400,
            f"{field} must have an alpha channel: its fully transparent pixels mark the area to edit",
            param=field,
        )
    alpha = np.asarray(image.convert("RGBA"), dtype=np.uint8)[..., 3]
    return np.where(alpha == 0, 255, 0).astype(np.uint8)


def _decode(data: bytes, field: str, max_pixels: int, mode: str) -> np.ndarray:
    unreadable = APIError(
        400, f"{field} is not an image this server can read: send an 8-bit PNG, JPEG or WebP", param=field
    )
    try:
        # Only these decoders are tried, so another format is never even parsed.
        with Image.open(io.BytesIO(data), formats=FORMATS) as image:
            if image.mode not in _MODES:
                raise unreadable
            width, height = image.size  # from the header: refuse huge images before decoding them
            if width * height > max_pixels:
                raise APIError(
                    413,
                    f"{field} is {width}x{height}, more than this server's limit of {max_pixels} pixels",
                    param=field,
                    code="image_too_large",
                )
            if mode == "mask":
                return edit_mask(image, field)
            return np.asarray(image.convert(mode), dtype=np.uint8)
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError, ValueError):
        # Pillow's own messages name internal objects and memory addresses: not for clients.
        raise unreadable from None
