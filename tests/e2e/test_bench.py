"""`diffbatch bench` for a few seconds on tiny-sd: the table, the JSON and the plots hold
every contender asked for, including a server that was already running (--url)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from bench.launch import start_server, stop_server

pytestmark = pytest.mark.slow

# The plain built-in `server` runs in the video and quality tests below; here its sibling with
# flags (server-seq1) stands for the built-in servers, to start one server fewer.
CONTENDERS = ["direct", "server-seq1", "wait5", "ext"]


def run_bench(*args: str) -> subprocess.CompletedProcess[str]:
    command = [str(Path(sys.executable).parent / "diffbatch"), "bench", *args]
    run = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    return run


def test_bench_command_runs_every_contender_and_workload(tmp_path: Path) -> None:
    external = start_server(tmp_path, "tiny-sd", "--num-threads", "1", config=None)
    out = tmp_path / "results"
    try:
        run = run_bench(
            "--model", "tiny-sd",
            "--size", "32x32",
            "--steps", "1",
            "--n", "1,2",
            "--threads", "1",
            "--requests", "4",
            "--rounds", "1",
            "--warmup", "1",
            "--workload", "closed:2",
            "--workload", "poisson:50%,20 steps=1,2",
            "--workload", "lone",
            "--contender", "wait5=--request-batch-max-wait-ms 5",
            "--contenders", "direct,server-seq1",
            "--url", f"ext={external.url}",
            "--out", str(out),
        )  # fmt: skip
    finally:
        stop_server(external)
    stdout = run.stdout
    assert stdout.startswith("# diffbatch bench --model tiny-sd")
    assert "model=tiny-sd" in stdout and "threads=1" in stdout and "cpu=" in stdout
    tables = [block for block in stdout.split("### ")[1:]]
    assert len(tables) == 4  # closed:2, poisson 50% and 20/s, lone
    for table in tables:
        rows = {line.split(" | ")[0].strip("| ") for line in table.splitlines() if line.startswith("| ")}
        assert set(CONTENDERS) <= rows, table
    assert "mean latency" in stdout and "over a direct one-request call" in stdout  # lone breakdown

    results = json.loads((out / "results.json").read_text())
    assert results["meta"]["model"] == "tiny-sd"
    assert results["meta"]["command"].startswith("diffbatch bench ")
    assert [w["kind"] for w in results["workloads"]] == ["closed", "poisson", "lone"]
    closed = results["workloads"][0]["levels"][0]["contenders"]
    assert sorted(closed) == sorted(CONTENDERS)
    for name, entry in closed.items():
        samples = entry["rounds"][0]["samples"]
        assert len(samples) == 4 and all(s["ok"] for s in samples), (name, samples)
        assert entry["figures"]["outputs_per_s"] > 0
    assert closed["server-seq1"]["figures"]["max_batch"] == 1  # read from the server's own /metrics
    assert closed["direct"]["figures"]["mean_batch"] is None  # direct has no server metrics
    poisson = results["workloads"][1]["levels"]
    assert poisson[0]["label"] == "50%" and poisson[0]["value"] > 0 and poisson[1]["value"] == 20

    plots = sorted(out.glob("*.png"))
    assert [p.name for p in plots] == ["1-closed.png", "2-poisson.png", "3-lone.png"]
    for plot in plots:
        with Image.open(plot) as image:
            assert image.width > 400


def test_bench_drives_video_models_through_the_videos_api(tmp_path: Path) -> None:
    run = run_bench(
            "--model", "tiny-wan",
            "--contenders", "direct,server",
            "--workload", "closed:2",
            "--requests", "2",
            "--rounds", "1",
            "--warmup", "1",
            "--steps", "1",
            "--threads", "1",
            "--out", str(tmp_path),
    )  # fmt: skip
    assert "modality=video" in run.stdout and "| videos/s |" in run.stdout
    results = json.loads((tmp_path / "results.json").read_text())
    served = results["workloads"][0]["levels"][0]["contenders"]["server"]
    assert [s["ok"] for s in served["rounds"][0]["samples"]] == [True, True]
    assert served["figures"]["mean_batch"] is not None  # the jobs ran through the engine


def test_bench_quality_scores_every_contender_against_the_reference(
    tmp_path: Path, standin_weights: Path
) -> None:
    """`--quality` on the untrained stand-in of `shapes` (tests/standin.py): its pictures are
    noise, so only the plumbing is checked — every contender and the reference draw the
    held-out prompts, are scored per attribute and compared; a server at the reference's
    steps draws the reference's pictures (batched = alone), one with fewer steps does not."""
    run = run_bench(
        "--model", str(standin_weights / "shapes"),
        "--contenders", "server",
        "--contender", "few=--default-steps 2",
        "--server-args", "--default-steps 4",
        "--reference-steps", "4",
        "--quality",
        "--steps", "1",
        "--threads", "1",
        "--requests", "2",
        "--rounds", "1",
        "--warmup", "1",
        "--workload", "closed:2",
        "--out", str(tmp_path),
    )  # fmt: skip
    section = run.stdout.split("## quality: 32 held-out prompts, seeds 1000-1031")[1]
    rows = {line.split(" | ")[0].strip("| ") for line in section.splitlines() if line.startswith("| ")}
    assert {"reference", "server", "few"} <= rows
    quality = json.loads((tmp_path / "results.json").read_text())["quality"]
    assert list(quality) == ["reference", "server", "few"]
    for entry in quality.values():
        assert entry["failed"] == 0 and entry["compared"] == 32
        assert entry["totals"]["background"] == 32 and set(entry["rates"]) >= {"colour", "shape", "count"}
    assert quality["reference"]["psnr_db"] == "inf"
    # Within 1/255 of the reference's pictures: batched = alone, step level = request level.
    assert quality["server"]["psnr_db"] > 48 and quality["server"]["ssim"] > 0.999
    assert quality["few"]["psnr_db"] < quality["server"]["psnr_db"]
    assert quality["few"]["ssim"] < quality["server"]["ssim"]
    grids = sorted(p.name for p in tmp_path.glob("quality-*.png"))
    assert grids == ["quality-few.png", "quality-reference.png", "quality-server.png"]
