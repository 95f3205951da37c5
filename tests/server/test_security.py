"""What a foreign web page or a careless client can make the server do: bodies it cannot
parse as asked, hosts and origins that are not this server's, links to a host the client
chose, repeated form fields and endless prompts."""

from __future__ import annotations

import asyncio
import logging
import threading

import pytest
from starlette.requests import Request

from server.cross_site import public_base_url
from server.listening import without_probes
from server.protocol import MAX_PROMPT_CHARS
from tests.media import png
from tests.server.conftest import ClientFactory, ImageFakePipeline
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


async def test_a_repeated_file_is_named_not_last_wins(make_client: ClientFactory) -> None:
    client = await make_client()
    image = ("a.png", png(8, 8), "image/png")
    mask = ("m.png", png(8, 8, mode="RGBA"), "image/png")
    edit = await client.post(
        "/v1/images/edits", data={"prompt": "a"}, files=[("image", image), ("mask", mask), ("mask", mask)]
    )
    assert "mask is given more than once" in assert_error(edit, 400, param="mask")
    for field in ("input_reference", "input_reference[image_url]"):
        video = await client.post("/v1/videos", data={"prompt": "a"}, files=[(field, image), (field, image)])
        assert "given more than once" in assert_error(video, 400, param="input_reference")


@pytest.mark.parametrize(
    ("url", "fields", "param"),
    [
        (URL, {"model": "m" * 100_000}, "model"),
        (URL, {"lora": "l" * 100_000}, "lora.name"),
        (URL, {"lora": {"name": "l" * 100_000}}, "lora.name"),
        ("/v1/videos", {"model": "m" * 100_000}, "model"),
    ],
)
async def test_model_and_adapter_names_are_bounded_and_not_echoed(
    make_client: ClientFactory, url: str, fields: dict[str, object], param: str
) -> None:
    client = await make_client()
    response = await client.post(url, json={"prompt": "a", **fields})
    assert_error(response, 400, param=param)
    assert len(response.content) < 1000


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


async def test_any_of_several_keys_opens_the_api(make_client: ClientFactory) -> None:
    client = await make_client(api_key="old,new")
    for key in ("old", "new"):
        assert (await client.get("/v1/models", headers={"authorization": f"Bearer {key}"})).status_code == 200
    assert_error(await client.get("/v1/models", headers={"authorization": "Bearer other"}), 401)


async def test_origins_opened_with_cors_may_call_from_a_browser(make_client: ClientFactory) -> None:
    client = await make_client(allowed_origins="https://app.example")
    preflight = await client.options(
        URL,
        headers={
            "origin": "https://app.example",
            "access-control-request-method": "POST",
            "access-control-request-headers": "content-type",
        },
    )
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == "https://app.example"
    allowed = await client.post(URL, json={"prompt": "a"}, headers={"origin": "https://app.example"})
    assert (
        allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == "https://app.example"
    )
    other = await client.post(URL, json={"prompt": "a"}, headers={"origin": "https://evil.example"})
    assert_error(other, 403, code="cross_origin")


# What the official JavaScript client sends from a browser page (openai-node: its platform
# headers, retry count and timeout, the key, and a caller's X-Request-Id).
SDK_HEADERS = (
    "authorization, content-type, x-request-id, x-stainless-arch, x-stainless-lang, "
    "x-stainless-os, x-stainless-package-version, x-stainless-retry-count, x-stainless-runtime, "
    "x-stainless-runtime-version, x-stainless-timeout"
)


async def test_an_allowed_page_may_use_the_official_js_client(make_client: ClientFactory) -> None:
    client = await make_client(allowed_origins="https://app.example", api_key="k")
    preflight = await client.options(
        URL,
        headers={
            "origin": "https://app.example",
            "access-control-request-method": "POST",
            "access-control-request-headers": SDK_HEADERS,
        },
    )
    assert preflight.status_code == 200, preflight.text
    allowed = {h.strip().lower() for h in preflight.headers["access-control-allow-headers"].split(",")}
    assert {h.strip() for h in SDK_HEADERS.split(",")} <= allowed
    sent = {"authorization": "Bearer k", "x-stainless-lang": "js", "x-stainless-retry-count": "0"}
    response = await client.post(
        URL,
        json={"prompt": "a"},
        headers={"origin": "https://app.example", "x-request-id": "page-7", **sent},
    )
    assert response.status_code == 200 and response.headers["x-request-id"] == "page-7"
    exposed = {h.strip().lower() for h in response.headers["access-control-expose-headers"].split(",")}
    assert {"x-request-id", "retry-after", "x-should-retry", "openai-poll-after-ms"} <= exposed


@pytest.mark.parametrize(
    ("origin", "method", "headers", "named"),
    [
        ("https://evil.example", "POST", "content-type", "https://evil.example"),
        ("https://app.example", "PUT", "content-type", "PUT"),
        ("https://app.example", "POST", "content-type, x-custom-thing", "x-custom-thing"),
    ],
)
async def test_a_refused_preflight_is_an_openai_error(
    make_client: ClientFactory, origin: str, method: str, headers: str, named: str
) -> None:
    client = await make_client(allowed_origins="https://app.example", api_key="k")
    preflight = await client.options(
        URL,
        headers={
            "origin": origin,
            "access-control-request-method": method,
            "access-control-request-headers": headers,
        },
    )
    assert named in assert_error(preflight, 400, code="cors_refused")


def test_the_quiet_access_log_leaves_out_probes_and_scrapes() -> None:
    def record(path: str) -> logging.LogRecord:
        args = ("127.0.0.1:5000", "GET", path, "1.1", 200)
        return logging.LogRecord("uvicorn.access", logging.INFO, "", 0, '%s - "%s %s HTTP/%s" %d', args, None)

    assert not without_probes(record("/health")) and not without_probes(record("/metrics?x=1"))
    assert without_probes(record("/v1/images/generations"))


def test_url_links_carry_the_root_path_behind_a_proxy() -> None:
    def request(host: str) -> Request:
        scope = {
            "type": "http",
            "scheme": "https",
            "server": ("10.0.0.5", 8000),
            "root_path": "/images-api",
            "path": "/images-api/v1/images/generations",
            "headers": [(b"host", host.encode())],
        }
        return Request(scope)

    named = public_base_url(request("images.example"), None, ["images.example"])
    assert named == "https://images.example/images-api/"
    # Any host accepted: the client's is not trusted, the address it reached is.
    anyhost = public_base_url(request("evil.example"), None, ["*"])
    assert anyhost == "https://10.0.0.5:8000/images-api/"
    assert public_base_url(request("x"), "https://cdn.example/a", ["*"]) == "https://cdn.example/a/"


async def test_a_request_id_is_echoed_and_names_the_request_in_the_engine(
    make_client: ClientFactory, pipeline: ImageFakePipeline
) -> None:
    client = await make_client()
    given = await client.post(URL, json={"prompt": "a"}, headers={"x-request-id": "client-42"})
    assert given.headers["x-request-id"] == "client-42"
    assert pipeline.forwards[-1] == ["client-42"]  # the engine's own id for it
    fresh = await client.post(URL, json={"prompt": "a"}, headers={"x-request-id": "not an id!"})
    assert fresh.headers["x-request-id"].startswith("req-")
    pipeline.gate = threading.Event()
    pipeline.started.clear()
    try:  # the same id again while the first is in progress: refused, not run twice
        first = asyncio.create_task(client.post(URL, json={"prompt": "a"}, headers={"x-request-id": "dup"}))
        await asyncio.to_thread(pipeline.started.wait, 5)
        second = await client.post(URL, json={"prompt": "a"}, headers={"x-request-id": "dup"})
        assert_error(second, 409, code="duplicate_request_id")
    finally:
        pipeline.gate.set()
    assert (await first).status_code == 200


async def test_a_malformed_host_is_a_400_not_a_500(make_client: ClientFactory) -> None:
    client = await make_client()
    assert_error(await client.get("/health", headers={"host": "[::1"}), 400, code="host_not_allowed")
