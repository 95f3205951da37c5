"""`diffbatch serve --cfg-parallel 2` and `--sequence-parallel 2`: a lane of two worker
processes sharing every step (its guided rows, or its tokens). The official client gets the
images a plain server gives (a guided request, one with a negative prompt, one without
guidance, sent together so they share steps); a member killed under load fails the lane's
running requests with 503 at once (the other member, waiting on an exchange, is not left to
its timeout), the lane restarts, and later requests are served."""

from __future__ import annotations

import base64
import io
import os
import re
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import openai
import pytest
from PIL import Image

from bench.launch import ServerProcess, spawn_server, stop_server, wait_until_ready
from tests.polling import wait_for
from tests.threads import THREADS

pytestmark = pytest.mark.slow

# (prompt, guidance, negative prompt): guided, guided with a negative, unguided. FLUX's
# guidance is its distilled embedding; the negative prompt brings true CFG (`TRUE_CFG`).
REQUESTS = [("a red cat", 7.5, None), ("a blue dog", 5.0, "blurry"), ("a green tree", 1.0, None)]
FLUX = "tiny-flux"


class Servers(NamedTuple):
    plain: ServerProcess  # tiny-sd (the default model) and tiny-flux, one device each
    lane: ServerProcess  # tiny-sd, --cfg-parallel 2
    tokens: ServerProcess  # tiny-flux, --sequence-parallel 2


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    """A plain server of both models and two lanes of two workers, loading at once."""
    threads = ("--num-threads", str(THREADS))
    lanes = ("--deadline-admission", "off")
    models = ("--model", "tiny-sd=tiny-sd", "--model", f"{FLUX}={FLUX}")
    started = Servers(
        spawn_server(tmp_path_factory.mktemp("plain"), *threads, *models, config=None),
        spawn_server(tmp_path_factory.mktemp("cfg-parallel"), *threads, "--cfg-parallel", "2", *lanes),
        spawn_server(
            tmp_path_factory.mktemp("sequence-parallel"),
            FLUX,
            *(*threads, "--sequence-parallel", "2", *lanes),
            config=None,
        ),
    )
    try:
        for server in started:
            wait_until_ready(server)
        yield started
    finally:
        for server in started:
            stop_server(server)


def generate(
    client: openai.OpenAI,
    index: int,
    prompt: str,
    guidance: float,
    negative: str | None,
    *,
    model: str | None = None,
    size: str = "64x64",
) -> np.ndarray:
    body: dict[str, Any] = {"seed": 100 + index, "guidance_scale": guidance, "num_inference_steps": 3}
    if negative is not None:
        body["negative_prompt"] = negative
        if model == FLUX:
            body["true_cfg_scale"] = 4.0
    result = client.images.generate(
        prompt=prompt, model=model or openai.omit, size=size, response_format="b64_json", extra_body=body
    )
    data = (result.data or [])[0].b64_json
    assert data is not None
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(data))).convert("RGB"))


def images(server: ServerProcess, model: str | None = None) -> list[np.ndarray]:
    with (
        openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0) as client,
        ThreadPoolExecutor(len(REQUESTS)) as pool,
    ):
        futures = [
            pool.submit(generate, client, i, *request, model=model) for i, request in enumerate(REQUESTS)
        ]
        return [future.result(timeout=180) for future in futures]


def test_the_lane_answers_the_images_a_plain_server_gives(servers: Servers) -> None:
    for got, expected in zip(images(servers.lane), images(servers.plain), strict=True):
        assert np.abs(got.astype(int) - expected.astype(int)).max() <= 1
    log = servers.lane.log.read_text()
    assert "as member 0 (gloo" in log and "as member 1 (gloo" in log


def test_the_sequence_parallel_lane_answers_the_images_a_plain_server_gives(servers: Servers) -> None:
    expected = images(servers.plain, FLUX)
    for got, reference in zip(images(servers.tokens, FLUX), expected, strict=True):
        assert np.abs(got.astype(int) - reference.astype(int)).max() <= 1
    log = servers.tokens.log.read_text()
    assert "ulysses tokens 0 of 2" in log and "ulysses tokens 1 of 2" in log
    # 36x36 is 9 x 9 tokens of tiny FLUX (4 pixels a side): no two equal shares.
    with (
        openai.OpenAI(base_url=servers.tokens.v1, api_key="unused", max_retries=0) as client,
        pytest.raises(openai.BadRequestError) as refused,
    ):
        generate(client, 0, "odd", 3.5, None, model=FLUX, size="36x36")
    assert refused.value.body["param"] == "size"  # type: ignore[index]
    assert "81 image tokens" in refused.value.body["message"]  # type: ignore[index]


def member_pids(server: ServerProcess) -> dict[int, int]:
    """The latest worker process of each member of the lane, by member."""
    joined = re.findall(
        r"worker process (\d+) joined a lane of 2 devices as member (\d)", server.log.read_text()
    )
    return {int(member): int(pid) for pid, member in joined}


def kill_the_helper_under_load(lane: ServerProcess, model: str | None = None) -> dict[int, int]:
    """Hold the lane's requests running, kill its member 1, and check that those running failed
    with 503 at once and that the whole lane is back; the members' new pids."""
    pids = member_pids(lane)
    helper = pids[1]
    # Stopped, the helper holds every step at its exchange: the lane's requests stay running
    # however fast this machine is.
    os.kill(helper, signal.SIGSTOP)
    try:
        with (
            openai.OpenAI(base_url=lane.v1, api_key="unused", max_retries=0, timeout=120) as client,
            ThreadPoolExecutor(3) as pool,
        ):
            held = [
                pool.submit(generate, client, i, *request, model=model) for i, request in enumerate(REQUESTS)
            ]
            wait_for(lambda: lane.metric("diffbatch_num_requests_running") >= 1, "the lane runs a request")
            os.kill(helper, signal.SIGKILL)
            # Those running fail at once, far below the group's 300 s timeout; those still
            # queued wait for the restarted lane and are served.
            failed = []
            for future in held:
                try:
                    assert future.result(timeout=90).shape == (64, 64, 3)
                except openai.InternalServerError as exc:
                    failed.append(exc)
            assert failed and all(exc.status_code == 503 for exc in failed)
            assert all(exc.body["code"] == "worker_restarting" for exc in failed)  # type: ignore[index]
            wait_for(lambda: lane.metric("diffbatch_workers_up") == 1, "the lane is back", timeout_s=180)
            restarted = member_pids(lane)
            assert restarted[0] != pids[0] and restarted[1] != helper  # the whole lane restarted
            assert generate(client, 9, "served again", 7.5, None, model=model).shape == (64, 64, 3)
            return restarted
    finally:
        if Path(f"/proc/{helper}").exists():
            os.kill(helper, signal.SIGKILL)


def test_a_member_killed_under_load_fails_the_lanes_requests_and_the_lane_restarts(servers: Servers) -> None:
    lane = servers.lane
    restarted = kill_the_helper_under_load(lane)
    # The lead killed while the lane is idle: the helper, in no exchange, would not notice;
    # the lane restarts it too (else the new lead would wait for a new helper that never
    # comes, and this request with it).
    os.kill(restarted[0], signal.SIGKILL)
    wait_for(lambda: member_pids(lane)[0] != restarted[0], "the lead is back")
    wait_for(lambda: lane.metric("diffbatch_workers_up") == 1, "the lane is back", timeout_s=180)
    assert member_pids(lane)[1] != restarted[1]
    with openai.OpenAI(base_url=lane.v1, api_key="unused", max_retries=0, timeout=120) as client:
        assert generate(client, 10, "served once more", 7.5, None).shape == (64, 64, 3)
    assert lane.metric("diffbatch_worker_restarts_total") == 4


def test_a_member_of_a_sequence_parallel_lane_killed_under_load_restarts_the_lane(servers: Servers) -> None:
    # The stopped helper holds the lead inside the forward's first token exchange (Ulysses'
    # all-to-all), not at the exchange after it: killed, the lead is killed too, at once.
    kill_the_helper_under_load(servers.tokens, FLUX)
    assert servers.tokens.metric("diffbatch_worker_restarts_total") == 2
