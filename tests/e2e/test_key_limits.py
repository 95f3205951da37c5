"""Per-key limits against a real server with several API keys, through the official client:
a key past its `max_queue` or `rate` gets 429 naming the limit (with Retry-After) while
another key is served. The server's pipeline holds a HOLD prompt until a gate file exists
(`tests.pipelines.custom:GatedTextToImage`), so nothing here depends on machine speed."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.conftest import Server, gated_env, start_server, stop_server
from tests.polling import wait_for

pytestmark = pytest.mark.slow

FAST = {"num_inference_steps": 2, "size": "32x32"}
KEYS = "sekrit-queue:max_queue=1,sekrit-rate:rate=0.001,sekrit-other:weight=2"


def client(server: Server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key=key, max_retries=0, timeout=120)


def refusal(server: Server, key: str, prompt: str) -> tuple[dict[str, Any], int]:
    """The error body of the 429 `key` gets for `prompt`, and its Retry-After."""
    with client(server, key) as api, pytest.raises(openai.RateLimitError) as caught:
        api.images.generate(prompt=prompt, extra_body=FAST)
    body: dict[str, Any] = caught.value.response.json()["error"]
    return body, int(caught.value.response.headers["Retry-After"])


def metrics(server: Server) -> str:
    return httpx.get(f"{server.url}/metrics", headers={"Authorization": "Bearer sekrit-other"}).text


def test_a_limited_key_gets_429_naming_its_limit_and_the_other_key_is_served(tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    server = start_server(
        tmp_path,
        "--pipeline-class",
        "tests.pipelines.custom:GatedTextToImage",
        "--api-key",
        KEYS,
        env=gated_env(gate),
    )
    try:
        with client(server, "sekrit-rate") as api:
            assert len(api.images.generate(prompt="first", extra_body=FAST).data or []) == 1
        error, retry_after = refusal(server, "sekrit-rate", "second")
        assert error["param"] == "rate" and "rate" in error["message"]
        assert retry_after > 900

        queue_key, other_key = client(server, "sekrit-queue"), client(server, "sekrit-other")
        with queue_key, other_key, ThreadPoolExecutor(2) as pool:
            held = pool.submit(queue_key.images.generate, prompt="HOLD", extra_body=FAST)
            wait_for(lambda: 'diffbatch_tenant_requests{tenant="key#1"} 1.0' in metrics(server), "held")
            error, retry_after = refusal(server, "sekrit-queue", "more")
            assert error["param"] == "max_queue" and "max_queue" in error["message"]
            assert retry_after >= 1
            other = pool.submit(other_key.images.generate, prompt="other", extra_body=FAST)
            gate.touch()
            assert len(held.result(timeout=120).data or []) == 1
            assert len(other.result(timeout=120).data or []) == 1
        text = metrics(server)
        assert 'diffbatch_tenant_refusals_total{limit="max_queue",tenant="key#1"} 1.0' in text
        assert 'diffbatch_tenant_refusals_total{limit="rate",tenant="key#2"} 1.0' in text
        assert "sekrit" not in text
    finally:
        gate.touch()
        stop_server(server)
