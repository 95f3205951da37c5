"""JSON bodies that carry base64 images, built without passing the images through a JSON
serializer: the body is dumped with an empty `b64_json` string where each image goes, and
the base64 bytes are joined in. Base64's alphabet needs no JSON escaping, so nothing is lost;
what is saved is the serializer reading each ~2.5 MB string for characters to escape, and
the copies between bytes and str (one join makes the body, instead of four copies)."""

from __future__ import annotations

import base64
from collections.abc import Sequence

# Where an image goes: an empty `b64_json` as pydantic and `json.dumps(separators=(",", ":"))`
# write it. It cannot occur inside a string value, whose quotes are escaped.
B64_SLOT = '"b64_json":""'


def fill_b64(json_text: str, images: Sequence[bytes]) -> bytes:
    """`json_text` as UTF-8 with its `B64_SLOT`s, in order, holding the base64 of `images`."""
    pieces = json_text.split(B64_SLOT)
    if len(pieces) != len(images) + 1:
        raise ValueError(f"{len(pieces) - 1} b64_json slots for {len(images)} images")
    out = [pieces[0].encode()]
    for image, piece in zip(images, pieces[1:], strict=True):
        out += [b'"b64_json":"', base64.b64encode(image), b'"', piece.encode()]
    return b"".join(out)
