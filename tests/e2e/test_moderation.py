"""Moderation end to end (`--safety-checker`): a server of the tiny pipeline whose RED prompts
come out pure red (`tests.pipelines.custom:RedPaintingTextToImage`), checked by
`tiny-safety-checker`, which flags pure red. Each group of requests is held behind a HOLD
request until all of it waits, so it joins, steps and is decoded together: the flagged
request gets OpenAI's content_policy_violation, its peers their images, streamed or not."""

from __future__ import annotations

import base64
import io
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from tests.e2e.conftest import Server, gated_env, start_server, stop_server
from tests.pipelines.custom import RED
from tests.polling import wait_for


@pytest.fixture(scope="module")
def gate(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gate") / "gate"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, gate: Path) -> Iterator[Server]:
    instance = start_server(
        tmp_path_factory.mktemp("moderation"),
        *("--safety-checker", "tiny-safety-checker"),
        *("--pipeline-class", "tests.pipelines.custom:RedPaintingTextToImage"),
        *("--deadline-admission", "off"),
        env=gated_env(gate),
    )
    yield instance
    stop_server(instance)


def client_of(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0)


def held_group(server: Server, gate: Path, calls: list[Callable[[], Any]]) -> list[Any]:
    """Run `calls` (each one request) while a HOLD request holds the worker, then let them
    go together: they join, step and finish as one group. Each call's result or exception."""
    gate.unlink(missing_ok=True)
    entered = gate.with_suffix(".entered")
    entered.unlink(missing_ok=True)
    with ThreadPoolExecutor(len(calls) + 1) as pool, client_of(server) as client:
        holder = pool.submit(client.images.generate, model="tiny-sd", prompt="HOLD the worker")
        wait_for(entered.exists, "the HOLD request holds the worker")
        futures = [pool.submit(call) for call in calls]
        wait_for(
            lambda: server.metric("diffbatch_num_requests_waiting") == len(calls), "the group waits behind it"
        )
        gate.touch()
        holder.result()
        return [_outcome(future) for future in futures]


def _outcome(future: Future[Any]) -> Any:
    try:
        return future.result()
    except Exception as exc:  # noqa: BLE001 - the test looks at it
        return exc


def decodes_of_three_or_more(server: Server) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    buckets = {
        le: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        for le in ("2.0", "+Inf")
        if line.startswith(f'diffbatch_decode_batch_size_bucket{{le="{le}"}}')
    }
    return buckets["+Inf"] - buckets["2.0"]


def flagged(server: Server, stage: str) -> float:
    return server.labelled_count(f'diffbatch_moderation_flagged_total{{stage="{stage}"}}')


def assert_content_policy_error(error: Any) -> None:
    assert isinstance(error, openai.APIError), error
    body = error.body if isinstance(error.body, dict) else {}
    body = body.get("error", body)
    assert body["code"] == "content_policy_violation"
    assert body["type"] == "invalid_request_error"


def pixels(b64: str | None) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64 or ""))).convert("RGB"))


def test_the_flagged_request_fails_and_its_batch_peers_get_their_images(server: Server, gate: Path) -> None:
    before = (decodes_of_three_or_more(server), flagged(server, "image"))
    with client_of(server) as client:

        def generate(prompt: str, moderation: Literal["auto", "low"] = "auto") -> Any:
            return client.images.generate(model="tiny-sd", prompt=prompt, moderation=moderation)

        red, lenient, peer = held_group(
            server,
            gate,
            [lambda: generate("RED apple"), lambda: generate("RED apple", "low"), lambda: generate("a pear")],
        )
    assert_content_policy_error(red)
    assert isinstance(red, openai.BadRequestError) and red.status_code == 400
    # moderation: low passes the same red image (the lenient threshold), unaltered.
    assert (pixels(lenient.data[0].b64_json) == RED).all()
    assert not (pixels(peer.data[0].b64_json) == RED).all()
    assert decodes_of_three_or_more(server) - before[0] >= 1  # the three were decoded together
    assert flagged(server, "image") - before[1] == 1


def streamed(client: openai.OpenAI, prompt: str) -> tuple[list[str], Exception | None]:
    """The event types of a stream with two previews, and the error that ended it, if any."""
    seen: list[str] = []
    try:
        for event in client.images.generate(model="tiny-sd", prompt=prompt, stream=True, partial_images=2):
            seen.append(event.type)
    except openai.APIError as exc:
        return seen, exc
    return seen, None


def test_a_flagged_stream_gets_the_error_and_no_preview_while_its_peer_streams(
    server: Server, gate: Path
) -> None:
    before = (flagged(server, "image"), flagged(server, "preview"))
    with client_of(server) as client:
        (red_events, red_error), (peer_events, peer_error) = held_group(
            server, gate, [lambda: streamed(client, "RED apple"), lambda: streamed(client, "a pear")]
        )
    # Its previews were red too: withheld, and the request ended with the error event.
    assert red_events == []
    assert_content_policy_error(red_error)
    assert peer_error is None
    assert peer_events == ["image_generation.partial_image"] * 2 + ["image_generation.completed"]
    assert flagged(server, "image") - before[0] == 1
    assert flagged(server, "preview") - before[1] == 2
