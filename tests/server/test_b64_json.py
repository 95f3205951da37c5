"""JSON bodies with base64 images joined in (`server.b64_json`): the same JSON a serializer
writes, for the answer and for a stream event."""

from __future__ import annotations

import base64
import json

import pytest

from server.b64_json import fill_b64
from server.protocol import ImageObject, ImagesResponse

IMAGES = [b"\x89PNG first", bytes(range(256))]


def test_an_answer_is_the_json_pydantic_writes_with_the_base64_in_it() -> None:
    def answer(data: list[ImageObject]) -> ImagesResponse:
        return ImagesResponse(created=1, data=data, output_format="png", size="8x8")

    slots = answer([ImageObject(b64_json="", seed=s) for s in (1, 2)]).model_dump_json(exclude_none=True)
    filled = [
        ImageObject(b64_json=base64.b64encode(i).decode(), seed=s)
        for s, i in zip((1, 2), IMAGES, strict=True)
    ]
    assert fill_b64(slots, IMAGES) == answer(filled).model_dump_json(exclude_none=True).encode()


def test_an_event_keeps_its_fields_and_order() -> None:
    text = json.dumps({"type": "x.completed", "b64_json": "", "seed": 3}, separators=(",", ":"))
    event = json.loads(fill_b64(text, IMAGES[:1]))
    assert list(event) == ["type", "b64_json", "seed"]
    assert base64.b64decode(event["b64_json"]) == IMAGES[0]


def test_a_slot_per_image_or_an_error() -> None:
    with pytest.raises(ValueError, match="1 b64_json slots for 2 images"):
        fill_b64('{"b64_json":""}', IMAGES)
