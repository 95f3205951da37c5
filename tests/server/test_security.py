"""What a foreign web page or a careless client can make the server do: bodies it cannot
parse as asked, hosts and origins that are not this server's, links to a host the client
chose, repeated form fields and endless prompts."""

from __future__ import annotations

import pytest

from server.protocol import MAX_PROMPT_CHARS
from tests.media import png
from tests.server.conftest import ClientFactory
from tests.server.test_images_api import assert_error

URL = "/v1/images/generations"


@pytest.mark.parametrize(
    ("url", "content_type"),
    [
        (URL, "text/plain"),
        (URL, "application/x-www-form-urlencoded"),
        ("/v1/videos", "text/plain"),
    ],
)
async def test_a_body_a_foreign_page_could_send_is_415(
    make_client: ClientFactory, url: str, content_type: str
) -> None:
    client = await make_client()
    response = await client.post(url, content=b'{"prompt": "a cat"}', headers={"content-type": content_type})
    message = assert_error(response, 415, code="unsupported_media_type")
    assert content_type in message


async def test_a_foreign_host_on_a_loopback_server_without_a_key_is_400(make_client: ClientFactory) -> None:
    client = await make_client()
    response = await client.post(URL, json={"prompt": "a"}, headers={"host": "evil.example:8000"})
    assert_error(response, 400, code="host_not_allowed")
    assert (await client.get("/health", headers={"host": "127.0.0.1:8000"})).status_code == 200


async def test_with_a_key_or_named_hosts_other_hosts_are_the_operators_choice(
    make_client: ClientFactory,
) -> None:
    keyed = await make_client(api_key="k")
    assert (await keyed.get("/health", headers={"host": "images.example"})).status_code == 200
    named = await make_client(allowed_hosts="localhost, images.example, *.corp.example")
    assert (await named.get("/health", headers={"host": "a.corp.example"})).status_code == 200
    assert_error(await named.get("/health", headers={"host": "127.0.0.1"}), 400, code="host_not_allowed")


async def test_a_cross_origin_request_to_a_server_without_a_key_is_403(make_client: ClientFactory) -> None:
    client = await make_client()
    foreign = await client.post(URL, json={"prompt": "a"}, headers={"origin": "https://evil.example"})
    assert_error(foreign, 403, code="cross_origin")
    same = await client.post(URL, json={"prompt": "a"}, headers={"origin": "http://localhost"})
    assert same.status_code == 200


async def test_url_links_never_carry_a_host_the_client_chose(make_client: ClientFactory) -> None:
    anyhost = await make_client(allowed_hosts="*")
    body = (
        await anyhost.post(
            URL, json={"prompt": "a", "response_format": "url"}, headers={"host": "evil.example"}
        )
    ).json()
    assert "evil.example" not in body["data"][0]["url"]
    public = await make_client(public_url="https://images.example.com/api/")
    body = (await public.post(URL, json={"prompt": "a", "response_format": "url"})).json()
    assert body["data"][0]["url"].startswith("https://images.example.com/api/generated/")


@pytest.mark.parametrize("field", ["prompt", "negative_prompt"])
async def test_prompts_are_bounded(make_client: ClientFactory, field: str) -> None:
    client = await make_client()
    payload = {"prompt": "a", field: "x" * (MAX_PROMPT_CHARS + 1)}
    message = assert_error(await client.post(URL, json=payload), 400, param=field)
    assert str(MAX_PROMPT_CHARS) in message


async def test_a_repeated_form_field_is_named_not_last_wins(make_client: ClientFactory) -> None:
    client = await make_client()
    form = {"prompt": ["one", "two"]}
    video = await client.post("/v1/videos", data=form, files={"unused": ("a.txt", b"", "text/plain")})
    assert "prompt is given more than once" in assert_error(video, 400, param="prompt")
    edit = await client.post(
        "/v1/images/edits", data=form, files={"image": ("a.png", png(8, 8), "image/png")}
    )
    assert "prompt is given more than once" in assert_error(edit, 400, param="prompt")


async def test_deeply_nested_json_is_a_400_not_a_500(make_client: ClientFactory) -> None:
    client = await make_client()
    body = b"[" * 100_000 + b"]" * 100_000
    for url in ("/v1/videos", URL):
        response = await client.post(url, content=body, headers={"content-type": "application/json"})
        assert response.status_code == 400, (url, response.text)


async def test_no_error_shows_internal_text(make_client: ClientFactory) -> None:
    client = await make_client()
    response = await client.post(URL, content=b'{"prompt": ', headers={"content-type": "application/json"})
    assert response.status_code == 400 and "Traceback" not in response.text
    assert isinstance(response.json()["error"]["message"], str)


async def test_with_a_key_metrics_and_the_api_description_are_not_public(make_client: ClientFactory) -> None:
    client = await make_client(api_key="k")
    assert_error(await client.get("/metrics"), 401, code="invalid_api_key")
    assert (await client.get("/metrics", headers={"authorization": "Bearer k"})).status_code == 200
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert (await client.get(path, headers={"authorization": "Bearer k"})).status_code == 404
    assert (await client.get("/health")).status_code == 200  # probes need no key
    public = await make_client()
    assert (await public.get("/openapi.json")).status_code == 200


async def test_health_answers_head_for_probes(make_client: ClientFactory) -> None:
    client = await make_client()
    response = await client.head("/health")
    assert response.status_code == 200 and response.content == b""
