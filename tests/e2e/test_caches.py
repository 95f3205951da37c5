"""The prompt and result caches in a real server (tiny-sd, step-level, the pipeline in a worker
process, so the prompt cache's counts cross from it), driven by the official `openai` client:
eight clients that share one prompt with different seeds encode it once; an exact repeat with
a seed is answered from the result cache, the same images."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from tests.e2e.conftest import Server, start_server, stop_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    instance = start_server(
        tmp_path_factory.mktemp("caches"),
        "--batching",
        "step",
        "--executor",
        "process",
        "--prompt-cache-mb",
        "64",
        "--result-cache-mb",
        "16",
        ready_timeout_s=600,  # a worker process loading on a busy machine
    )
    yield instance
    stop_server(instance)


def generate(server: Server, seed: int) -> str:
    with openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0) as client:
        result = client.images.generate(
            model="tiny-sd", prompt="a red cat on the moon", size="64x64", extra_body={"seed": seed}
        )
    assert result.data is not None and result.data[0].b64_json is not None
    return result.data[0].b64_json


def test_eight_clients_sharing_a_prompt_encode_it_once(server: Server) -> None:
    with ThreadPoolExecutor(8) as pool:
        images = list(pool.map(lambda seed: generate(server, seed), range(8)))
    assert len(set(images)) == 8  # different seeds, different images
    # Guided (CFG): each request has a prompt and a negative ("") to encode: 16 texts, two of
    # them different, each encoded once, at least 8 times fewer than without the cache.
    misses = server.metric("diffbatch_prompt_cache_misses_total")
    hits = server.metric("diffbatch_prompt_cache_hits_total")
    assert (misses, hits) == (2.0, 14.0)
    assert server.metric("diffbatch_prompt_cache_entries") == 2.0
    assert server.metric("diffbatch_prompt_cache_bytes") > 0


def test_an_exact_repeat_with_a_seed_is_answered_from_the_result_cache(server: Server) -> None:
    before = server.metric("diffbatch_result_cache_hits_total")
    first = generate(server, 1234)
    assert generate(server, 1234) == first
    assert server.metric("diffbatch_result_cache_hits_total") == before + 1
