"""Several models behind one server (`--model NAME=SOURCE`, YAML `models:`): each endpoint
serves its model with the official client, a broken model fails only its own requests, and
a memory budget for two of three models unloads idle ones — never one that is working."""

from __future__ import annotations

import base64
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from tests.e2e.conftest import Server, gated_env, start_server, stop_server
from tests.media import png
from tests.polling import wait_for

pytestmark = pytest.mark.slow

FAST = {"seed": 7, "num_inference_steps": 2}


def image_bytes(client: openai.OpenAI, model: str, prompt: str = "a red square") -> bytes:
    result = client.images.generate(model=model, prompt=prompt, size="64x64", extra_body=FAST)
    assert result.data is not None
    return base64.b64decode(result.data[0].b64_json or "")


def test_an_image_an_edit_and_a_video_model_in_one_server(tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()  # a directory without model_index.json
    several = start_server(
        tmp_path,
        "--model",
        "img=tiny-sd",
        "--model",
        "edit=tiny-qwen-image-edit",
        "--model",
        "vid=tiny-wan",
        "--model",
        f"broken={broken}",
        config=None,
    )
    alone = None
    try:
        with openai.OpenAI(base_url=several.v1, api_key="unused", max_retries=0) as client:
            listed = {card.id for card in client.models.list().data}
            assert listed == {"img", "edit", "vid", "broken"}
            served = image_bytes(client, "img")
            assert image_bytes(client, "img") == served  # the default model too
            edited = client.images.edit(
                model="edit", image=("p.png", png(48, 32), "image/png"), prompt="blue", extra_body=FAST
            )
            assert edited.data is not None and edited.data[0].b64_json
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                video = client.videos.create_and_poll(
                    model="vid",
                    prompt="waves",
                    seconds="1",  # type: ignore[arg-type]
                    size="32x32",  # type: ignore[arg-type]
                    poll_interval_ms=100,
                    extra_body={"fps": "8", "num_inference_steps": "2"},
                )
            assert video.status == "completed", video.error
            # An endpoint that does not fit the model: 400 naming model.
            with pytest.raises(openai.BadRequestError) as wrong:
                client.images.generate(model="vid", prompt="x", size="64x64", extra_body=FAST)
            assert wrong.value.body["param"] == "model"  # type: ignore[index]
            with pytest.raises(openai.NotFoundError):
                client.images.generate(model="nope", prompt="x")
            # The broken model fails its own requests with its reason; the others serve on.
            with pytest.raises(openai.InternalServerError) as failed:
                client.images.generate(model="broken", prompt="x", size="64x64", extra_body=FAST)
            assert failed.value.status_code == 503 and "broken" in str(failed.value.body)
            assert image_bytes(client, "img") == served
        cards = {card["id"]: card for card in httpx.get(f"{several.v1}/models").json()["data"]}
        assert cards["img"]["endpoints"] == ["image"] and cards["img"]["loaded"]
        assert cards["img"]["state"] == "loaded" and cards["broken"]["state"] == "failed"
        assert cards["edit"]["endpoints"] == ["edit"] and cards["vid"]["endpoints"] == ["video"]
        assert cards["broken"]["endpoints"] is None and cards["broken"]["loaded"] is False
        health = httpx.get(f"{several.url}/health").json()
        assert health["status"] == "ok"
        assert health["models"]["broken"]["state"] == "failed" and health["models"]["broken"]["reason"]
        assert health["models"]["img"]["state"] == "loaded"
        # The same request to a server of that one model: the same image.
        (tmp_path / "alone").mkdir()
        alone = start_server(tmp_path / "alone", "tiny-sd", config=None)
        with openai.OpenAI(base_url=alone.v1, api_key="unused", max_retries=0) as client:
            assert image_bytes(client, "tiny-sd") == served
    finally:
        stop_server(several)
        if alone is not None:
            stop_server(alone)


# tiny-sd's weights are 4.78 MB: a 12 MB budget holds two of them, not three (checked below).
BUDGET_MB = 12


def test_a_budget_for_two_of_three_models_unloads_idle_ones_never_a_busy_one(tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    config = tmp_path / "models.yaml"
    config.write_text(
        f"models_memory_mb: {BUDGET_MB}\n"
        "models:\n"
        "  - {name: a, model: tiny-sd, batching: request, "
        "pipeline_class: 'tests.pipelines.custom:GatedTextToImage'}\n"
        "  - {name: b, model: tiny-sd}\n"
        "  - {name: c, model: tiny-sd}\n"
    )
    server = start_server(tmp_path, "--config", str(config), config=None, env=gated_env(gate))
    try:
        with openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0) as client:
            image_bytes(client, "a")
            footprint = server.metric("diffbatch_models_resident_bytes")
            assert 2 * footprint <= BUDGET_MB * 2**20 < 3 * footprint, footprint
            for model in ("b", "c", "a", "b", "c"):  # round robin: every request served
                image_bytes(client, model)
            assert evictions(server) >= 3
            assert server.metric("diffbatch_models_resident_bytes") <= BUDGET_MB * 2**20
            # a works (held by the gate) and has a request queued: b and c take turns in the
            # room left, a stays loaded throughout.
            with ThreadPoolExecutor(2) as pool:
                held = pool.submit(image_bytes, client, "a", "HOLD")
                wait_for(gate.with_suffix(".entered").exists, "the held request running")
                queued = pool.submit(image_bytes, client, "a", "queued")
                wait_for(lambda: server.metric("diffbatch_num_requests_waiting") >= 1, "one queued")
                before = evictions(server)
                for model in ("b", "c", "b"):
                    image_bytes(client, model)
                    assert model_state(server, "a") == "loaded"
                assert evictions(server) >= before + 2  # b and c unloaded each other
                gate.touch()
                held.result(timeout=120)
                queued.result(timeout=120)
    finally:
        stop_server(server)


def evictions(server: Server) -> float:
    lines = httpx.get(f"{server.url}/metrics").text.splitlines()
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("diffbatch_model_evictions_total")
    )


def model_state(server: Server, name: str) -> str:
    state: str = httpx.get(f"{server.url}/health").json()["models"][name]["state"]
    return state


def test_a_host_budget_parks_the_idle_model_and_brings_it_back(tmp_path: Path) -> None:
    """Room for one of two models on the device and one on the host: each switch parks the
    idle model and brings the other back (no load after the first two); images are the same
    as when each was first loaded; the counters in /metrics never go backwards."""
    server = start_server(
        tmp_path,
        *("--model", "a=tiny-sd", "--model", "b=tiny-sd"),  # 4.78 MB each: one fits 6 MiB
        *("--models-memory-mb", "6", "--models-host-memory-mb", "6"),
        config=None,
    )
    try:
        with openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0) as client:
            first = {model: image_bytes(client, model) for model in ("a", "b")}
            assert model_state(server, "a") == "parked"
            for model in ("a", "b", "a"):
                assert image_bytes(client, model) == first[model]
            assert model_state(server, "b") == "parked"
        text = httpx.get(f"{server.url}/metrics").text
        assert 'diffbatch_model_loads_total{model="a"} 1.0' in text
        assert 'diffbatch_model_unparks_total{model="a"} 2.0' in text
        assert server.metric("diffbatch_models_parked_bytes") > 0
    finally:
        stop_server(server)
