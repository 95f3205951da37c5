"""`Idempotency-Key` on the image POSTs against a real `diffbatch serve`: the official
client's retry after a lost answer gets the first answer, the model runs once, and work
with a key is not abandoned when its client leaves (its retry joins it)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import httpx2
import openai
import pytest

from tests.e2e.conftest import Server
from tests.polling import until

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]


class LosesTheFirstAnswer(httpx2.BaseTransport):
    """Lets the first POST reach the server and run, then loses its answer (a timeout, as a
    dropped connection looks to a client). Written on httpx2, the official client's own HTTP
    library."""

    def __init__(self) -> None:
        self._inner = httpx2.HTTPTransport()
        self.lost: list[dict[str, object]] = []

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        if request.method != "POST" or self.lost:
            return self._inner.handle_request(request)
        response = self._inner.handle_request(request)
        self.lost.append(json.loads(response.read()))
        response.close()
        raise httpx2.ReadTimeout("the answer was lost", request=request)

    def close(self) -> None:
        self._inner.close()


def test_the_official_clients_retry_with_one_key_runs_the_model_once(server: Server) -> None:
    transport = LosesTheFirstAnswer()
    key = {"Idempotency-Key": f"cat-{time.time_ns()}"}  # the package's server is shared
    forwarded = server.metric("diffbatch_batch_size_sum")  # requests the model has run
    with openai.OpenAI(
        base_url=server.v1,
        api_key="unused",
        max_retries=2,
        http_client=openai.DefaultHttpxClient(transport=transport),
    ) as client:
        result = client.images.generate(
            prompt="one cat",
            size="64x64",
            response_format="b64_json",
            extra_body={"seed": 7},
            extra_headers=key,
        )
        assert len(transport.lost) == 1 and result.data is not None
        first = transport.lost[0]["data"]
        assert isinstance(first, list) and result.data[0].b64_json == first[0]["b64_json"]
        assert result.created == transport.lost[0]["created"]  # the first answer itself
        assert server.metric("diffbatch_batch_size_sum") - forwarded == 1
        with pytest.raises(openai.ConflictError) as reused:  # 409, not retried (x-should-retry)
            client.images.generate(
                prompt="two cats",
                size="64x64",
                response_format="b64_json",
                extra_body={"seed": 7},
                extra_headers=key,
            )
        assert reused.value.body["param"] == "Idempotency-Key"  # type: ignore[index]
        assert server.metric("diffbatch_batch_size_sum") - forwarded == 1


def test_work_with_a_key_outlives_its_client_so_the_retry_joins_it(server: Server) -> None:
    forwarded = server.metric("diffbatch_batch_size_sum")
    interrupted = server.metric("diffbatch_forwards_interrupted_total")
    key = {"Idempotency-Key": f"left-{time.time_ns()}"}
    ask = {"prompt": "a patient cat", "size": "64x64", "num_inference_steps": 30, "seed": 3}

    async def leave_then_retry() -> httpx.Response:
        async with httpx.AsyncClient(base_url=server.v1, timeout=600) as client:
            first = asyncio.create_task(client.post("/images/generations", json=ask, headers=key))
            await until(lambda: server.metric("diffbatch_num_requests_running") >= 1, "the first running")
            first.cancel()  # the client goes away mid-forward
            await asyncio.gather(first, return_exceptions=True)
            return await client.post("/images/generations", json=ask, headers=key)

    retry = asyncio.run(leave_then_retry())
    assert retry.status_code == 200 and len(retry.json()["data"]) == 1
    assert server.metric("diffbatch_batch_size_sum") - forwarded == 1  # one run, not two
    assert server.metric("diffbatch_forwards_interrupted_total") == interrupted
