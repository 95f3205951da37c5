"""Every curl line and Python example of the README and the docs pages, run against a live
server (tests/doc_pages.py finds them wherever they are)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from server.settings import ServeSettings
from tests.doc_pages import code_blocks, command_lines, pages, run_command_line, section
from tests.e2e.conftest import Server, start_server, stop_server

pytestmark = pytest.mark.slow


def curl_commands() -> list[str]:
    """Every curl line of every page, each once."""
    return command_lines("bash", "curl")


def is_video(command: str) -> bool:
    """A video line for tiny-wan; those with a control video run in tests/e2e/test_vace_videos.py."""
    return "/v1/videos" in command and not is_controlled_video(command)


def is_controlled_video(command: str) -> bool:
    return "video=@" in command


def is_edit(command: str) -> bool:
    return "/v1/images/edits" in command


def is_variation(command: str) -> bool:
    """A line for an image-to-image model, run in tests/e2e/test_edits.py."""
    return "/v1/images/variations" in command


def is_lora(command: str) -> bool:
    """Lines of the LoRA section, which need a server with its adapters (tests/e2e/test_lora.py)."""
    return '"model": "pixel"' in command


def is_controlnet(command: str) -> bool:
    """Lines of the ControlNet section, which need a server with one (tests/e2e/test_controlnet.py):
    a JSON `controlnet` field, or an edit form's `controlnet[0][...]` fields."""
    return '"controlnet"' in command or "controlnet[" in command


def is_ip_adapter(command: str) -> bool:
    """Lines of the IP-Adapter section, which need a server with one (tests/e2e/test_ip_adapter.py):
    a JSON `ip_adapter` field, or an edit form's `ip_adapter[0][...]` fields."""
    return '"ip_adapter"' in command or "ip_adapter[" in command


ENDPOINTS = (
    "/v1/images/generations",
    "/v1/images/edits",
    "/v1/images/variations",
    "/v1/models",
    "/health",
    "/metrics",
    "/v1/videos",
)


def test_the_docs_have_curl_examples_for_every_endpoint() -> None:
    text = " ".join(curl_commands())
    for path in ENDPOINTS:
        assert path in text


def test_the_readme_itself_shows_an_image_and_a_video_with_curl() -> None:
    """The front door's examples are among the lines run here."""
    _, readme = next(pages())
    curls = [line for line in command_lines("bash", "curl") if line in readme.replace("\\\n", " ")]
    assert any("/v1/images/generations" in line for line in curls)
    assert any("/v1/videos" in line for line in curls)


@pytest.mark.parametrize(
    "command",
    [
        c
        for c in curl_commands()
        if not any(
            test(c)
            for test in (
                is_video,
                is_controlled_video,
                is_edit,
                is_variation,
                is_lora,
                is_controlnet,
                is_ip_adapter,
            )
        )
    ],
)
def test_readme_curl_line_works(server: Server, command: str) -> None:
    output = run_command_line(command, server.url)
    assert output
    if "/metrics" in command:
        assert "diffbatch_batch_size" in output
    elif '"stream": true' in command:
        events = [json.loads(line[6:]) for line in output.splitlines() if line.startswith("data: ")]
        assert events and all(e["type"] == "image_generation.completed" for e in events)
    else:
        body = json.loads(output)
        assert "error" not in body, body
        if "/images/generations" in command:
            assert body["data"] and all(("b64_json" in d) or ("url" in d) for d in body["data"])


@pytest.mark.parametrize("example", code_blocks("python"))
def test_readme_python_example_works(server: Server, tmp_path: Path, example: str) -> None:
    script = example.replace("http://localhost:8000", server.url)
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in tmp_path.glob("fox-*.png")) == ["fox-0.png", "fox-1.png"]


def test_readme_flag_table_covers_every_setting() -> None:
    """Every setting has its row in the flag table of "Serving options"."""
    rows = [line for line in section("Serving options").splitlines() if line.startswith("| `--")]
    documented = " ".join(row.split(" | ")[0] for row in rows)
    for name in ServeSettings.model_fields:
        if name != "model":
            assert f"`--{name.replace('_', '-')}`" in documented, name


def test_readme_video_curl_lines_work_in_order(tmp_path: Path) -> None:
    """Against `diffbatch serve tiny-wan`, with VIDEO_ID a finished video of this server."""
    video_server = start_server(tmp_path, "tiny-wan", config=None)
    try:
        created = httpx.post(f"{video_server.v1}/videos", json={"prompt": "a boat", "seconds": 1}).json()
        for _ in range(600):
            if httpx.get(f"{video_server.v1}/videos/{created['id']}").json()["status"] == "completed":
                break
            time.sleep(0.05)
        for command in (c for c in curl_commands() if is_video(c)):
            output = run_command_line(command.replace("VIDEO_ID", created["id"]), video_server.url, tmp_path)
            if " -o " in command:
                name = command.split(" -o ")[1].split()[0]
                assert (tmp_path / name).stat().st_size > 0, command
            else:
                body = json.loads(output)
                assert body.get("error") is None, (command, body)
        assert (tmp_path / "boat.mp4").read_bytes()[4:8] == b"ftyp"
    finally:
        stop_server(video_server)
