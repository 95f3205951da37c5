"""`/metrics` of several API processes (`server.metrics`, prometheus-client's multiprocess
files): every family is exported as in one process, counted by any process or not yet by
any, with its own help text (no server process; milliseconds)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from prometheus_client.mmap_dict import MmapedDict, mmap_key

from server.metrics import MULTIPROC_VARIABLE, Metrics


async def _engine_text() -> bytes:
    return b""


def _scrape(metrics: Metrics) -> str:
    return asyncio.run(metrics.exposition()).decode()


def test_a_family_no_process_has_counted_yet_is_exported_as_in_one_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    one = _scrape(Metrics())
    monkeypatch.setenv(MULTIPROC_VARIABLE, str(tmp_path))
    several = _scrape(Metrics(_engine_text))
    # As the text format names them: a counter's family by its samples' `_total`.
    families = ("diffbatch_lora_forwards_total", "diffbatch_requests_refused_total", "diffbatch_batch_size")
    for family in families:
        for line in (f"# TYPE {family} ", f"# HELP {family} "):
            declared = [x for x in one.splitlines() if x.startswith(line)]
            assert declared and declared == [x for x in several.splitlines() if x.startswith(line)]


def test_what_the_processes_counted_is_added_up_under_the_families_help(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(MULTIPROC_VARIABLE, str(tmp_path))
    key = mmap_key("diffbatch_lora_forwards", "diffbatch_lora_forwards_total", ["adapter"], ["none"], "")
    for pid in (101, 102):  # the engine process, and one that died
        counts = MmapedDict(str(tmp_path / f"counter_{pid}.db"))  # type: ignore[no-untyped-call]
        counts.write_value(key, 2.0, 0.0)  # type: ignore[no-untyped-call]
        counts.close()  # type: ignore[no-untyped-call]
    text = _scrape(Metrics(_engine_text))
    assert 'diffbatch_lora_forwards_total{adapter="none"} 4.0' in text
    assert "# HELP diffbatch_lora_forwards_total pipeline forwards" in text
    assert text.count("# TYPE diffbatch_lora_forwards_total counter") == 1
