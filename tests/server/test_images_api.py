"""`/v1/images/generations` and friends, in process, over a fake image pipeline."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from PIL import Image

from engine.core.engine import AsyncEngine
from engine.executor.thread_executor import ThreadExecutor
from engine.request import RequestBatch, RequestOutput
from server.app import create_app
from tests.polling import until
from tests.server.conftest import ClientFactory, ImageFakePipeline, settings_for, wait_ready

URL = "/v1/images/generations"


def decode(b64: str) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(b64)))


def assert_error(
    response: httpx.Response, status: int, param: str | None = None, code: str | None = None
) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if param is not None:
        assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    message: str = error["message"]
    return message


async def test_generation_returns_images_of_the_asked_size_with_seeds(make_client: ClientFactory) -> None:
    client = await make_client()
    response = await client.post(URL, json={"prompt": "a cat", "n": 2, "size": "96x64", "seed": 41})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["size"] == "96x64" and body["output_format"] == "png"
    assert [d["seed"] for d in body["data"]] == [41, 42]
    assert all("revised_prompt" not in d for d in body["data"])  # the prompt is never rewritten
    image = decode(body["data"][0]["b64_json"])
    assert image.format == "PNG" and image.size == (96, 64)
    assert image.getpixel((0, 0)) == (41, 0, 7)


@pytest.mark.parametrize(("fmt", "pil_format"), [("jpeg", "JPEG"), ("webp", "WEBP")])
async def test_output_formats(make_client: ClientFactory, fmt: str, pil_format: str) -> None:
    client = await make_client()
    response = await client.post(
        URL, json={"prompt": "a cat", "output_format": fmt, "output_compression": 80}
    )
    assert response.status_code == 200, response.text
    assert decode(response.json()["data"][0]["b64_json"]).format == pil_format


async def test_size_auto_uses_the_model_default(make_client: ClientFactory) -> None:
    client = await make_client()
    body = (await client.post(URL, json={"prompt": "a cat", "size": "auto"})).json()
    assert body["size"] == "64x64"


@pytest.mark.parametrize(
    ("payload", "param", "fragment"),
    [
        ({"prompt": ["a", "b"]}, "prompt", "one request per prompt"),
        ({"prompt": "a", "size": "big"}, "size", "WIDTHxHEIGHT"),
        ({"prompt": "a", "size": "2048x64"}, "size", "width too large"),
        ({"prompt": "a", "n": 0}, "n", "greater than or equal to 1"),
        ({"prompt": "a", "n": 11}, "n", "less than or equal to 10"),
        ({"prompt": ""}, "prompt", "at least 1"),
        ({"n": 1}, "prompt", "required"),
        ({"prompt": "a", "num_inference_step": 4}, "num_inference_step", "unknown parameter"),
        ({"prompt": "a", "output_format": "gif"}, "output_format", "png"),
        ({"prompt": "a", "negative_prompt": ["x", "y"]}, "negative_prompt", "one string"),
        ({"prompt": "a", "background": "transparent"}, "background", "opaque images"),
        ({"prompt": "a", "cache": {"mode": "teacache"}}, "cache.mode", "first-block"),
        ({"prompt": "a", "cache": {"mode": "first-block", "threshold": 2}}, "cache.threshold", "less than"),
        ({"prompt": "a", "cache": {"mode": "first-block", "thresh": 0.1}}, "cache.thresh", "unknown"),
        ({"prompt": "a", "cache": {"mode": "taylorseer", "threshold": 0.1}}, "cache.threshold", "applies"),
        ({"prompt": "a", "cache": {"mode": "taylorseer", "interval": 0}}, "cache.interval", "greater than"),
        ({"prompt": "a", "cache": {"mode": "taylorseer", "order": 9}}, "cache.order", "less than"),
        ({"prompt": "a", "cache": {"mode": "first-block", "warmup": 2}}, "cache.warmup", "taylorseer"),
        # JSON is taken as typed: a string or a boolean is not quietly a number.
        ({"prompt": "a", "priority": "1"}, "priority", "must be an integer, not a string"),
        ({"prompt": "a", "timeout": True}, "timeout", "must be a number, not a boolean"),
        ({"prompt": "a", "n": 1.5}, "n", "must be an integer, not a number"),
        ({"prompt": "a", "stream": 1}, "stream", "must be true or false, not a number"),
        ({"prompt": 5}, "prompt", "must be a string, not a number"),
        ({"prompt": "a", "cache": {"mode": "first-block", "threshold": True}}, "cache.threshold", "boolean"),
        ({"prompt": "a", "cache": []}, "cache", "must be a JSON object, not an array"),
        ({"prompt": "a", "lora": {"name": "x", "scale": "1"}}, "lora.scale", "not a string"),
        ({"prompt": "a", "lora": 5}, "lora", "an adapter name or an object"),
    ],
)
async def test_bad_input_is_a_400_naming_the_field(
    make_client: ClientFactory, payload: dict[str, Any], param: str, fragment: str
) -> None:
    client = await make_client()
    message = assert_error(await client.post(URL, json=payload), 400, param=param)
    assert fragment in message


async def test_list_prompt_points_to_the_batching_docs(make_client: ClientFactory) -> None:
    client = await make_client()
    message = assert_error(await client.post(URL, json={"prompt": ["a", "b"]}), 400, "prompt")
    assert "README" in message and "batched automatically" in message


async def test_malformed_bodies(make_client: ClientFactory) -> None:
    client = await make_client()
    assert_error(
        await client.post(URL, content=b"{not json", headers={"content-type": "application/json"}), 400
    )
    assert_error(await client.post(URL, json=["a list"]), 400)


async def test_unknown_model_is_404(make_client: ClientFactory) -> None:
    client = await make_client()
    assert_error(
        await client.post(URL, json={"prompt": "a", "model": "dall-e-3"}), 404, "model", "model_not_found"
    )
    assert (await client.post(URL, json={"prompt": "a", "model": "test-model"})).status_code == 200


async def test_models_list(make_client: ClientFactory) -> None:
    client = await make_client()
    body = (await client.get("/v1/models")).json()
    assert body["object"] == "list" and [m["id"] for m in body["data"]] == ["test-model"]


async def test_api_key_guards_v1_only(make_client: ClientFactory) -> None:
    client = await make_client(api_key="sekrit")
    assert_error(await client.post(URL, json={"prompt": "a"}), 401, code="invalid_api_key")
    assert_error(await client.get("/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
    assert (await client.get("/v1/models", headers={"Authorization": "Bearer sekrit"})).status_code == 200
    assert (await client.get("/health")).status_code == 200


async def test_url_response_serves_the_file(make_client: ClientFactory) -> None:
    client = await make_client()
    body = (
        await client.post(URL, json={"prompt": "a", "response_format": "url", "output_format": "jpeg"})
    ).json()
    url = body["data"][0]["url"]
    assert "b64_json" not in body["data"][0]
    fetched = await client.get(url)
    assert fetched.status_code == 200 and fetched.headers["content-type"] == "image/jpeg"
    assert Image.open(io.BytesIO(fetched.content)).size == (64, 64)
    assert_error(await client.get("/generated/nope.png"), 404)


async def test_stream_sends_one_completed_event_per_image(make_client: ClientFactory) -> None:
    client = await make_client()
    response = await client.post(URL, json={"prompt": "a", "n": 2, "stream": True, "seed": 3})
    assert response.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: ")]
    assert [e["type"] for e in events] == ["image_generation.completed"] * 2
    assert [e["seed"] for e in events] == [3, 4]
    assert decode(events[0]["b64_json"]).size == (64, 64)


async def test_images_are_encoded_in_the_encoding_pool(
    make_client: ClientFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Answers and stream events alike: in the pool's own threads, never on the event loop
    or in asyncio's default pool (where file and database calls would queue behind them)."""
    threads: list[str] = []

    def recorded(encode: Any) -> Any:
        def encode_here(*args: Any) -> bytes:
            threads.append(threading.current_thread().name)
            return encode(*args)  # type: ignore[no-any-return]

        return encode_here

    import server.image_answer
    import server.streaming

    for module in (server.image_answer, server.streaming):
        monkeypatch.setattr(module, "encode_image", recorded(module.encode_image))
    client = await make_client()
    plain = await client.post(URL, json={"prompt": "a", "n": 2, "seed": 5})
    streamed = await client.post(URL, json={"prompt": "a", "stream": True, "seed": 5})
    assert plain.status_code == streamed.status_code == 200
    first = plain.json()["data"][0]["b64_json"]
    events = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert events[0]["b64_json"] == first  # the same image, the same bytes
    assert len(threads) == 3 and all(name.startswith("diffbatch-encode") for name in threads), threads


async def test_a_failure_after_the_stream_started_is_an_error_event(make_client: ClientFactory) -> None:
    client = await make_client()
    response = await client.post(URL, json={"prompt": "FAIL", "stream": True, "partial_images": 2})
    assert response.status_code == 200  # sent before the failure was known
    lines = response.text.splitlines()
    assert "event: error" in lines
    (event,) = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    assert event["type"] == "error" and event["error"]["code"] == "generation_failed"
    assert "marked request failed" in event["error"]["message"]


async def test_a_refused_stream_is_an_http_error(make_client: ClientFactory) -> None:
    client = await make_client()
    response = await client.post(URL, json={"prompt": "a", "stream": True, "size": "2048x64"})
    assert response.status_code == 400 and response.headers["content-type"] == "application/json"


async def test_body_too_large_is_413(make_client: ClientFactory) -> None:
    client = await make_client(max_body_mb=0.001)
    assert_error(await client.post(URL, json={"prompt": "a" * 5000}), 413, code="request_too_large")

    async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: the limit acts while reading
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"a" * 500
        yield b'"}'

    chunked = await client.post(URL, content=chunks(), headers={"content-type": "application/json"})
    assert "content-length" not in chunked.request.headers
    assert_error(chunked, 413, code="request_too_large")


async def test_pipeline_failure_is_500_without_a_stack_trace(make_client: ClientFactory) -> None:
    client = await make_client()
    response = await client.post(URL, json={"prompt": "FAIL"})
    message = assert_error(response, 500, code="generation_failed")
    assert "Traceback" not in message and "marked request failed" in message
    assert response.headers["x-should-retry"] == "false"  # the same input fails again


async def queued(client: httpx.AsyncClient, count: int) -> bool:
    """Whether the server's /metrics shows `count` requests waiting in its queue."""
    metrics = (await client.get("/metrics")).text
    return f"diffbatch_num_requests_waiting {float(count)}" in metrics


async def test_queue_full_is_429_with_retry_after(
    make_client: ClientFactory, pipeline: ImageFakePipeline
) -> None:
    pipeline.gate = threading.Event()
    client = await make_client(max_queue_len=1, max_num_seqs=1)
    try:
        running = asyncio.create_task(client.post(URL, json={"prompt": "a"}))
        await asyncio.to_thread(pipeline.started.wait, 5)
        waiting = asyncio.create_task(client.post(URL, json={"prompt": "b"}))
        await until(lambda: queued(client, 1), "the second request waits in the queue")
        response = await client.post(URL, json={"prompt": "c"})
        assert_error(response, 429, code="queue_full")
        assert int(response.headers["retry-after"]) >= 1 and response.headers["x-should-retry"] == "true"
    finally:
        pipeline.gate.set()
    assert (await running).status_code == 200 and (await waiting).status_code == 200


async def test_deadline_is_504(make_client: ClientFactory, pipeline: ImageFakePipeline) -> None:
    pipeline.gate = threading.Event()
    client = await make_client(request_timeout_s=0.1)
    try:
        response = await client.post(URL, json={"prompt": "a"})
        assert_error(response, 504, code="timeout")
        assert response.headers["x-should-retry"] == "false"  # it would only run out of time again
    finally:
        pipeline.gate.set()


async def test_metrics_count_requests_and_batches(make_client: ClientFactory) -> None:
    client = await make_client()
    await client.post(URL, json={"prompt": "a", "n": 2})
    await client.post(URL, json={"prompt": ["bad"]})
    text = (await client.get("/metrics")).text
    assert 'diffbatch_requests_total{endpoint="/v1/images/generations",status="200"} 1.0' in text
    assert 'diffbatch_requests_total{endpoint="/v1/images/generations",status="400"} 1.0' in text
    assert "diffbatch_batch_images_sum 2.0" in text
    for name in (
        "diffbatch_request_latency_seconds",
        "diffbatch_queue_wait_seconds",
        "diffbatch_batch_size",
        "diffbatch_forward_seconds",
        "diffbatch_num_requests_waiting",
        "diffbatch_num_requests_running",
        "diffbatch_requests_aborted_total",
    ):
        assert name in text


async def test_a_bad_request_says_not_to_retry(make_client: ClientFactory) -> None:
    client = await make_client()
    response = await client.post(URL, json={"prompt": "a", "n": 0})
    assert response.status_code == 400 and response.headers["x-should-retry"] == "false"


class MemoryFakePipeline(ImageFakePipeline):
    """Runs out of memory above 4 images in one forward; records every forward's size."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    def forward(self, batch: RequestBatch) -> list[RequestOutput]:
        self.sizes.append(batch.num_images)
        if batch.num_images > 4:
            raise MemoryError("out of memory (fake)")
        return super().forward(batch)


async def test_out_of_memory_serves_everyone_and_caps_the_shape(tmp_path: Path) -> None:
    pipeline = MemoryFakePipeline()
    settings = settings_for(tmp_path, max_num_seqs=8, request_batch_max_wait_ms=2000)
    app = create_app(settings, AsyncEngine(ThreadExecutor(lambda: pipeline), settings.engine_config()))
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost") as client,
    ):
        await wait_ready(client)
        for round_ in range(2):
            bodies = [{"prompt": f"{round_}-{i}", "seed": i} for i in range(8)]
            responses = await asyncio.gather(*(client.post(URL, json=body) for body in bodies))
            assert [r.status_code for r in responses] == [200] * 8
        metrics = (await client.get("/metrics")).text
    # The first batch over 4 (8, or fewer where a request's parsing outlasted the batch wait
    # on a busy machine) ran out of memory and was split; from then on, batches of that shape
    # hold 4 at most, so it was the only one.
    assert len([size for size in pipeline.sizes if size > 4]) == 1
    assert "diffbatch_out_of_memory_total 1.0" in metrics
    (cap_line,) = [line for line in metrics.splitlines() if line.startswith("diffbatch_batch_image_cap{")]
    assert cap_line.endswith(" 4.0")
