"""`diffbatch serve --compile blocks`: the warm-up at start compiles before the server
answers /health (its log says how many graphs, in how long), and requests of different n
and steps, sent together so their groups grow and shrink, compile nothing more
(`diffbatch_denoiser_recompiles_total` stays 0) — step level in a worker process, request
level in the server's thread."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from tests.e2e.conftest import start_server, stop_server
from tests.threads import THREADS

pytestmark = [pytest.mark.slow]


@pytest.mark.parametrize(("executor", "batching"), [("process", "step"), ("thread", "request")])
def test_a_compiled_server_warms_up_at_start_and_never_recompiles(
    tmp_path: Path, executor: str, batching: str
) -> None:
    flags = ["tiny-flux", "--compile", "blocks", "--executor", executor, "--batching", batching]
    flags += ["--num-threads", str(THREADS), "--log-level", "info", "--request-batch-max-wait-ms", "500"]
    # Inductor compiles slowly on a shared CPU: the hang guard is long, the wait is /health.
    server = start_server(tmp_path, *flags, config=None, ready_timeout_s=1800)
    try:
        assert re.search(r"compile warm-up: \d+ graphs compiled in [\d.]+ s", server.log.read_text())
        shapes = [(1, 2), (2, 3), (1, 4), (3, 2)]
        with (
            OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=600) as client,
            ThreadPoolExecutor(len(shapes)) as pool,
        ):

            def generate(shape: tuple[int, int]) -> int:
                n, steps = shape
                extra = {"seed": steps, "num_inference_steps": steps}
                response = client.images.generate(model="tiny-flux", prompt="a cat", n=n, extra_body=extra)
                return len(response.data or [])

            assert list(pool.map(generate, shapes)) == [n for n, _ in shapes]
        metrics = httpx.get(f"{server.url}/metrics").text
        assert re.search(r"^diffbatch_denoiser_recompiles_total 0\.0$", metrics, re.MULTILINE), metrics
    finally:
        stop_server(server)
