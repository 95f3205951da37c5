"""`diffbatch bench` with a service-level workload for a few seconds on tiny-sd: a class mix
with priorities and deadlines, two tenants with their own API keys, and the priority,
fifo and alone arms on one server; the report and the JSON hold every figure."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.test_bench import run_bench

pytestmark = pytest.mark.slow

WORKLOAD = (
    "poisson:50% class=i share=3 steps=1,2 priority=0 deadline=2x class=b steps=3 priority=10 "
    "tenants=2 rates=3:1"
)


def test_bench_reports_service_levels_per_arm(tmp_path: Path) -> None:
    run = run_bench(
        "--model", "tiny-sd",
        "--size", "32x32",
        "--threads", "1",
        "--requests", "6",
        "--rounds", "1",
        "--warmup", "1",
        "--contenders", "server",
        "--compare", "priority,fifo,alone:2",
        "--workload", WORKLOAD,
        "--out", str(tmp_path),
    )  # fmt: skip
    stdout = run.stdout
    assert "arms=['priority', 'fifo', 'alone:2'] tenants=2" in stdout
    assert "| contender | class | requests | SLO met |" in stdout
    assert "| contender | tenant |" in stdout and "| contender | priority |" in stdout
    assert "> server/fifo: " in stdout and "preemptions" in stdout  # counted, or said to be absent

    level = json.loads((tmp_path / "results.json").read_text())["workloads"][0]["levels"][0]
    assert sorted(level["contenders"]) == ["server/alone:2", "server/fifo", "server/priority"]
    prioritized = level["contenders"]["server/priority"]
    samples = prioritized["rounds"][0]["samples"]
    assert len(samples) == 6 and all(s["ok"] for s in samples), samples  # each tenant's key let in
    timed = [s for s in samples if s["klass"] == "i"]
    assert timed and all(s["deadline_s"] > 0 and s["priority"] == 0 for s in timed)
    assert all(s["priority"] == 0 for s in level["contenders"]["server/fifo"]["rounds"][0]["samples"])
    assert all(s["tenant"] == 2 for s in level["contenders"]["server/alone:2"]["rounds"][0]["samples"])
    assert set(prioritized["service_levels"]["by_class"]) <= {"i", "b"}
    assert set(prioritized["service_levels"]["by_tenant"]) <= {"1", "2"}
