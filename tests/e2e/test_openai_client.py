"""The official `openai` client and httpx against a real `diffbatch serve` process."""

from __future__ import annotations

import asyncio
import base64
import io
from collections.abc import Iterator

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from tests.e2e.conftest import Server
from tests.e2e.sharing import ATTEMPTS

pytestmark = pytest.mark.slow

FAST = {"num_inference_steps": 2}


def client_for(server: Server, **kwargs: object) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key=kwargs.pop("api_key", "unused"), max_retries=0, **kwargs)  # type: ignore[arg-type]


@pytest.fixture
def client(server: Server) -> Iterator[openai.OpenAI]:
    """The official client of the shared server, closed after the test (an unclosed one
    leaves a socket for the garbage collector: a ResourceWarning in a later test)."""
    with client_for(server) as opened:
        yield opened


def pixels(b64: str | None) -> np.ndarray:
    assert b64 is not None
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))))


def test_generate_with_the_official_client(client: openai.OpenAI) -> None:
    result = client.images.generate(
        model="tiny-sd",
        prompt="a cat",
        n=2,
        size="64x64",
        response_format="b64_json",
        extra_body={"seed": 1234, **FAST},
    )
    assert result.data is not None and len(result.data) == 2
    first, second = (pixels(d.b64_json) for d in result.data)
    assert first.shape == (64, 64, 3) and second.shape == (64, 64, 3)
    again = client.images.generate(prompt="a cat", n=2, size="64x64", extra_body={"seed": 1234, **FAST})
    assert again.data is not None
    assert np.array_equal(pixels(again.data[0].b64_json), first)  # same request, same image
    single = client.images.generate(prompt="a cat", size="64x64", extra_body={"seed": 1234, **FAST})
    assert single.data is not None
    # Alone (a batch of 1, not 2) the same seed gives the same image to within 1/255.
    assert np.abs(pixels(single.data[0].b64_json).astype(int) - first.astype(int)).max() <= 1
    assert np.abs(first.astype(int) - second.astype(int)).max() > 10
    assert (result.model_extra or {}).get("size", result.size) == "64x64"


def test_eight_concurrent_requests_make_one_forward_of_eight(server: Server) -> None:
    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.v1, timeout=60) as client:
            return await asyncio.gather(
                *(
                    client.post("/images/generations", json={"prompt": f"prompt {i}", "seed": i, **FAST})
                    for i in range(8)
                )
            )

    # Arrivals 50 ms apart end the admission wait (its quiet window): a machine busy enough
    # to part the burst is tried again, never passed.
    forwards = []
    for _ in range(ATTEMPTS):
        count_before = server.metric("diffbatch_batch_size_count")
        sum_before = server.metric("diffbatch_batch_size_sum")
        responses = asyncio.run(burst())
        assert [r.status_code for r in responses] == [200] * 8
        assert server.metric("diffbatch_batch_size_sum") - sum_before == 8
        forwards.append(server.metric("diffbatch_batch_size_count") - count_before)
        if forwards[-1] == 1:
            return
    raise AssertionError(f"eight requests sent at once took {forwards} forwards, never one")


@pytest.mark.parametrize(
    ("kwargs", "error", "param"),
    [
        ({"prompt": ["a", "b"]}, openai.BadRequestError, "prompt"),
        ({"prompt": "a", "size": "65x65"}, openai.BadRequestError, "size"),
        ({"prompt": "a", "n": 0}, openai.BadRequestError, "n"),
        ({"prompt": "a", "model": "dall-e-3"}, openai.NotFoundError, "model"),
    ],
)
def test_errors_reach_the_client_as_openai_errors(
    client: openai.OpenAI, kwargs: dict[str, object], error: type[openai.APIStatusError], param: str
) -> None:
    with pytest.raises(error) as raised:
        client.images.generate(**kwargs)  # type: ignore[call-overload]
    body = raised.value.body
    assert isinstance(body, dict) and body["param"] == param and body["message"]


def test_list_prompt_message_tells_what_to_do(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        client.images.generate(prompt=["a", "b"])  # type: ignore[call-overload]
    assert "one request per prompt" in raised.value.message


def test_a_request_beyond_the_work_budget_is_refused_and_one_within_runs(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        client.images.generate(prompt="a cat", extra_body={"num_inference_steps": 1000})
    assert "work budget" in raised.value.message
    assert raised.value.body["param"] == "num_inference_steps"  # type: ignore[index]
    # 16 times the default request (64x64, 8 steps) is the budget: 4x the size and 4x the steps
    # fit (tests/pipelines/test_work.py), one step more does not.
    with pytest.raises(openai.BadRequestError) as over:
        client.images.generate(prompt="a cat", size="128x128", extra_body={"num_inference_steps": 33})
    assert over.value.body["param"] == "num_inference_steps"  # type: ignore[index]
    assert "asks for 540,672 pixel-steps" in over.value.message and "budget of 524,288" in over.value.message
    result = client.images.generate(prompt="a cat", size="128x128", extra_body={"num_inference_steps": 2})
    assert result.data is not None and pixels(result.data[0].b64_json).shape == (128, 128, 3)


def test_malformed_body_is_a_400_error_object(server: Server) -> None:
    response = httpx.post(
        f"{server.v1}/images/generations", content=b"{oops", headers={"content-type": "application/json"}
    )
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_streaming_with_the_official_client(client: openai.OpenAI) -> None:
    stream = client.images.generate(
        prompt="a red bicycle", n=2, size="64x64", stream=True, extra_body={"seed": 5, **FAST}
    )
    events = list(stream)
    assert [event.type for event in events] == ["image_generation.completed"] * 2
    first = events[0]
    assert first.type == "image_generation.completed"
    assert pixels(first.b64_json).shape == (64, 64, 3) and first.size == "64x64"


def test_a_loopback_server_without_a_key_refuses_what_a_foreign_page_could_send(server: Server) -> None:
    url = f"{server.v1}/images/generations"
    plain = httpx.post(url, content=b'{"prompt": "a"}', headers={"content-type": "text/plain"})
    assert plain.status_code == 415
    rebound = httpx.post(url, json={"prompt": "a", **FAST}, headers={"host": "attacker.example:8000"})
    assert rebound.status_code == 400 and rebound.json()["error"]["code"] == "host_not_allowed"
    cross = httpx.post(url, json={"prompt": "a", **FAST}, headers={"origin": "https://attacker.example"})
    assert cross.status_code == 403
