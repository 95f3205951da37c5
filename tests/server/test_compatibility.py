"""The OpenAI compatibility table (docs/api.md) is kept true: every field of the official
client's parameter types appears in it for its endpoint, every endpoint the client calls is
listed, and what the table says of ignored and refused fields is what the server does."""

from __future__ import annotations

import inspect
import re
import typing

import openai
import pytest
from openai.types import (
    image_create_variation_params,
    image_edit_params,
    image_generate_params,
    video_create_params,
    video_download_content_params,
    video_list_params,
    video_remix_params,
)

from server.routes.unsupported import UNSUPPORTED
from tests.doc_pages import section
from tests.media import png
from tests.server.conftest import ClientFactory

CLIENT_FIELDS = {
    "POST /v1/images/generations": image_generate_params.ImageGenerateParamsBase,
    "POST /v1/images/edits": image_edit_params.ImageEditParamsBase,
    "POST /v1/images/variations": image_create_variation_params.ImageCreateVariationParams,
    "POST /v1/videos": video_create_params.VideoCreateParams,
    "POST /v1/videos/{id}/remix": video_remix_params.VideoRemixParams,
    "GET /v1/videos/{id}/content": video_download_content_params.VideoDownloadContentParams,
    "GET /v1/videos": video_list_params.VideoListParams,
}


def table() -> list[tuple[str, set[str], str]]:
    """(endpoint, fields, what diffbatch does) per row of the compatibility table."""
    rows = []
    for line in section("OpenAI compatibility").splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("`"):
            continue
        rows.append((cells[0], set(re.findall(r"`([a-z_]+)`", cells[1])), cells[2]))
    return rows


def fields_said_for(endpoint: str) -> dict[str, str]:
    return {field: says for cell, fields, says in table() for field in fields if f"`{endpoint}`" in cell}


@pytest.mark.parametrize("endpoint", list(CLIENT_FIELDS))
def test_every_client_field_is_in_the_table(endpoint: str) -> None:
    client_fields = set(typing.get_type_hints(CLIENT_FIELDS[endpoint]))
    missing = client_fields - set(fields_said_for(endpoint))
    assert not missing, f"{endpoint}: the compatibility table does not say what happens to {sorted(missing)}"


def test_every_endpoint_the_client_calls_is_in_the_table() -> None:
    source = inspect.getsource(openai.resources.images) + inspect.getsource(openai.resources.videos)
    paths = {re.sub(r"\{[a-z_]+\}", "{id}", p) for p in re.findall(r'"(/(?:images|videos)[^"]*)"', source)}
    listed = " ".join(cell for cell, _, _ in table())
    for path in paths:
        assert f"/v1{path}`" in listed, f"{path} is not in the compatibility table"
    unsupported = {re.sub(r"\{[a-z_]+\}", "{id}", path) for _, path in UNSUPPORTED}
    for path in unsupported:
        assert path in listed


SAMPLES: dict[str, object] = {
    "style": "vivid",
    "moderation": "low",
    "complexity": "low",
    "user": "someone",
    "safety_identifier": "hash",
    "frame_count": 4,
    "frame_duration_ms": 100,
    "svg": {"model": "any"},
}


@pytest.mark.parametrize(
    "field", sorted(f for f, says in fields_said_for("POST /v1/images/generations").items() if f in SAMPLES)
)
async def test_generation_fields_do_what_the_table_says(make_client: ClientFactory, field: str) -> None:
    says = fields_said_for("POST /v1/images/generations")[field]
    client = await make_client()
    response = await client.post(
        "/v1/images/generations", json={"prompt": "a cat", "size": "64x64", field: SAMPLES[field]}
    )
    if says.startswith("ignored"):
        assert response.status_code == 200, response.text
    else:
        assert says.startswith("refused")
        assert response.status_code == 400 and response.json()["error"]["param"] == field, response.text


async def test_edit_markup_is_refused_by_name(make_client: ClientFactory) -> None:
    client = await make_client()
    response = await client.post(
        "/v1/images/edits",
        data={"prompt": "a cat"},
        files={"image": ("a.png", b"png", "image/png"), "markup": ("m.png", b"png", "image/png")},
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == "markup"


@pytest.mark.parametrize(
    ("data", "param"),
    [
        ({}, "model"),  # a text-to-image model: no image-to-image to draw a variation with
        ({"prompt": "a cat"}, "prompt"),  # a variation has none
        ({"stream": "true"}, "stream"),  # OpenAI's variations answer JSON only
    ],
)
async def test_variations_refuse_by_name(
    make_client: ClientFactory, data: dict[str, str], param: str
) -> None:
    client = await make_client()
    response = await client.post(
        "/v1/images/variations", data=data, files={"image": ("a.png", png(8, 8), "image/png")}
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


@pytest.mark.parametrize(("method", "path"), list(UNSUPPORTED))
async def test_unsupported_endpoints_say_so(make_client: ClientFactory, method: str, path: str) -> None:
    client = await make_client()
    response = await client.request(method, path.replace("{character_id}", "c1"), json={})
    error = response.json()["error"]
    assert response.status_code == 404 and error["code"] == "unsupported_endpoint"
    assert "not supported" in error["message"]
