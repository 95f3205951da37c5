"""The `diffbatch` command: help, bad settings, and API keys on a real server."""

from __future__ import annotations

import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from bench.launch import spawn_server
from server.output_dir import lock_output_dir
from server.settings import ServeSettings
from tests.e2e.conftest import start_server, stop_server

pytestmark = pytest.mark.slow

DIFFBATCH = str(Path(sys.executable).parent / "diffbatch")


def run(*args: str) -> subprocess.CompletedProcess[str]:
    # A hang guard, far above a loaded machine's time: a worker-process start that refuses its
    # flag took over 60 s at a load of 10 on 2 cores.
    return subprocess.run([DIFFBATCH, *args], capture_output=True, text=True, timeout=600, check=False)


def test_serve_help_documents_every_setting() -> None:
    result = run("serve", "--help")
    assert result.returncode == 0
    for name in ServeSettings.model_fields:
        if name != "model":
            assert f"--{name.replace('_', '-')}" in result.stdout


def test_unknown_config_key_stops_start_up_naming_it(tmp_path: Path) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text("model: tiny-sd\nmax_num_seq: 4\n")
    result = run("serve", "--config", str(config))
    assert result.returncode == 2
    assert "max_num_seq: unknown setting" in result.stderr


def test_bad_flag_value_stops_start_up_naming_it() -> None:
    result = run("serve", "--request-batch-max-wait-ms", "-5")
    assert result.returncode == 2
    assert "request_batch_max_wait_ms" in result.stderr


def test_a_model_that_cannot_load_exits_non_zero(tmp_path: Path) -> None:
    result = run("serve", str(tmp_path), "--port", "0")
    assert result.returncode == 1
    assert "not a diffusers pipeline directory" in result.stderr


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--transformer-file", "{tmp}/missing.gguf"],
            "--transformer-file: {tmp}/missing.gguf: no such file",
        ),
        (["--transformer-file", "{tmp}/text.gguf"], "--transformer-file: {tmp}/text.gguf is not a GGUF file"),
        (
            ["--transformer-file", "{tmp}/text.safetensors"],
            "is neither a GGUF file (named .gguf) nor a safetensors",
        ),
        (
            ["--component-dtypes", "vea=float32"],
            "--component-dtypes: the model has no component 'vea'; it has",
        ),
        (["--quantize-components", "unet", "vea"], "--quantize-components: the model has no component 'vea'"),
        (
            ["--pipeline-class", "os:system"],
            "--pipeline-class: os:system is not a subclass of pipelines.base",
        ),
        (
            ["--pipeline-class", "no_such_module:Adapter"],
            "--pipeline-class: no module named 'no_such_module'",
        ),
    ],
)
def test_a_flag_the_model_refuses_stops_start_up_in_one_line_before_listening(
    tmp_path: Path, flags: list[str], message: str
) -> None:
    """Checked before the server listens (the shipped `shapes` model's index is on disk):
    exit 2 and one line naming the flag, no traceback, no port opened."""
    (tmp_path / "text.gguf").write_text("not a model\n")
    (tmp_path / "text.safetensors").write_text("not a model\n")
    flags = [flag.format(tmp=tmp_path) for flag in flags]
    result = run("serve", "shapes", "--port", "0", "--output-dir", str(tmp_path / "out"), *flags)
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.splitlines()
    assert line.startswith("diffbatch: --") and message.format(tmp=tmp_path) in line, line
    assert result.stdout == ""


def test_a_flag_only_the_worker_can_check_ends_the_server_the_same_way(tmp_path: Path) -> None:
    """A worker process imports the pipeline class (the server does not import it for it):
    its refusal ends the server with exit 2 and the same line, without a traceback."""
    result = run(
        "serve",
        "shapes",
        "--executor",
        "process",
        "--pipeline-class",
        "os:system",
        "--port",
        "0",
        "--output-dir",
        str(tmp_path / "out"),
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()
    assert lines[-1] == "diffbatch: --pipeline-class: os:system is not a subclass of pipelines.base.Pipeline"
    assert "Traceback" not in result.stderr


def test_api_key_is_enforced_on_a_real_server(tmp_path: Path) -> None:
    server = start_server(tmp_path, env={"DIFFBATCH_API_KEY": "s3cret"})
    try:
        # Clients are closed, so no socket is left for the garbage collector to warn about.
        with (
            openai.OpenAI(base_url=server.v1, api_key="wrong", max_retries=0) as wrong,
            pytest.raises(openai.AuthenticationError),
        ):
            wrong.models.list()
        with openai.OpenAI(base_url=server.v1, api_key="s3cret", max_retries=0) as right:
            models = right.models.list()
        assert [m.id for m in models.data] == ["tiny-sd"]
    finally:
        stop_server(server)


def test_a_second_server_on_the_same_output_dir_refuses_to_start(tmp_path: Path) -> None:
    server = start_server(tmp_path)
    try:
        second = run("serve", "--port", "0", "--output-dir", str(tmp_path / "outputs"))
        assert second.returncode == 2
        assert f"pid {server.process.pid}" in second.stderr and "--output-dir" in second.stderr
    finally:
        stop_server(server)
    # Once the first has stopped, the directory is free again: the lock a third server would
    # take at start is there to take.
    with lock_output_dir(tmp_path / "outputs"):
        pass


def test_https_with_a_certificate_made_here(tmp_path: Path) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
            "-keyout", str(key), "-out", str(cert),
            "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )  # fmt: skip
    server = spawn_server(tmp_path, "--ssl-certfile", str(cert), "--ssl-keyfile", str(key))
    url = server.url.replace("http://", "https://")
    trust = ssl.create_default_context(cafile=str(cert))
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.process.poll() is None, server.log.read_text()
            try:
                if httpx.get(f"{url}/health", verify=trust, timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                assert time.monotonic() < deadline, server.log.read_text()
                time.sleep(0.2)
        with openai.OpenAI(
            base_url=f"{url}/v1",
            api_key="unused",
            max_retries=0,
            http_client=openai.DefaultHttpxClient(verify=trust),
        ) as client:
            result = client.images.generate(
                prompt="a cat", size="64x64", extra_body={"num_inference_steps": 2}
            )
        assert result.data is not None and result.data[0].b64_json
        with pytest.raises(httpx.HTTPError):  # plain HTTP is not served on the TLS port
            httpx.get(f"{server.url}/health", timeout=5)
    finally:
        stop_server(server)
