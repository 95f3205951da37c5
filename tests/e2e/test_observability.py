"""What an operator watches, against one real server of two models in worker processes, with
API keys, the result cache and a safety checker: its logs as JSON (`--log-format json`), every
line of them, and the Grafana dashboard in deploy/, every metric of which the server exports."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server.api_keys import ApiKey
from tests.e2e.conftest import ROOT, Server, start_server, stop_server

KEY = "sk-observed"
DASHBOARD = ROOT / "deploy" / "grafana-dashboard.json"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """Requests sent: one image of each model (so each loads, and model a is evicted or
    parked for b), a repeat answered by the result cache, and a failing one (FAIL)."""
    instance = start_server(
        tmp_path_factory.mktemp("observability"),
        *("--log-format", "json", "--executor", "process", "--api-key", KEY),
        *("--model", "a=tiny-sd", "--model", "b=tiny-sd"),
        *("--models-memory-mb", "6", "--models-host-memory-mb", "6", "--result-cache-mb", "8"),
        *("--safety-checker", "tiny-safety-checker"),
        *("--pipeline-class", "tests.pipelines.custom:RedPaintingTextToImage"),
        config=None,
        env={"PYTHONPATH": str(ROOT)},
    )
    with openai.OpenAI(base_url=instance.v1, api_key=KEY, max_retries=0) as client:
        for model in ("a", "b", "b"):  # b twice: the second is the result cache's
            client.images.generate(model=model, prompt="a lighthouse", extra_body={"seed": 7})
        with pytest.raises(openai.InternalServerError):
            client.images.generate(model="a", prompt="FAIL on purpose")
    yield instance
    stop_server(instance)


def log_lines(server: Server) -> list[dict[str, Any]]:
    """Every line the server wrote (stdout and stderr share its log file), each parsed as
    JSON: one that is not fails the test."""
    entries = []
    for number, line in enumerate(server.log.read_text().splitlines(), 1):
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            raise AssertionError(f"log line {number} is not JSON: {line!r}") from None
        assert isinstance(entry, dict), line
        entries.append(entry)
    return entries


def test_every_log_line_is_json_and_tells_each_requests_life(server: Server) -> None:
    entries = log_lines(server)
    for entry in entries:
        assert {"timestamp", "level", "logger", "message"} <= set(entry), entry
    # Worker processes write to the same stderr, in JSON too.
    assert len({entry["pid"] for entry in entries}) >= 2
    events: dict[str, list[dict[str, Any]]] = {}
    for entry in entries:
        if "event" in entry:
            events.setdefault(entry["request_id"], []).append(entry)
    lives = {rid: [e["event"] for e in each] for rid, each in events.items()}
    ran = [rid for rid, life in lives.items() if life == ["received", "queued", "finished"]]
    assert len(ran) == 3, lives  # a, b, FAIL; the cache's answer never queued
    assert ["received"] in lives.values()
    tenant = ApiKey(KEY).tenant()
    finished = {events[rid][-1]["outcome"] for rid in ran}
    assert finished == {"ok", "error"}
    for rid in ran:
        for entry in events[rid]:
            assert entry["tenant"] == tenant and entry["model"] in ("a", "b")
    # uvicorn's access lines are JSON, with the request they answered.
    access = [e for e in entries if e["logger"] == "uvicorn.access" and e.get("request_id") in events]
    assert {e["status"] for e in access} == {200, 500}
    # The failure's traceback is one field of one line, from the worker that ran it.
    failure = next(rid for rid in ran if events[rid][-1]["outcome"] == "error")
    logged = [e for e in entries if failure in e["message"] and "exc_info" in e]
    assert logged and "marked to fail" in logged[0]["exc_info"]


# Words of PromQL (and of Grafana's label_values) that are not metric names.
_NOT_METRICS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset"}
_NOT_METRICS |= {"and", "or", "unless", "inf", "nan"}


def metric_names(expression: str) -> set[str]:
    """The metric names a PromQL expression selects (a histogram's with its _bucket suffix)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', "", expression)  # strings (label values, legends)
    text = re.sub(r"\{[^}]*\}", "", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", "", text)  # ranges, $__rate_interval
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", text)
    words = re.finditer(r"(?<![\w$.])([a-zA-Z_:][a-zA-Z0-9_:]*)\b(?!\s*\()", text)
    return {m.group(1) for m in words if m.group(1).lower() not in _NOT_METRICS}


def scrape(server: Server) -> str:
    response = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {KEY}"})
    response.raise_for_status()
    return response.text


def exported_names(server: Server) -> set[str]:
    """Every series name /metrics has or declares: a sample's, or for a family without
    samples yet (a labelled counter nothing has counted) the names its type gives it."""
    names: set[str] = set()
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}
    for family in text_string_to_metric_families(scrape(server)):
        names.update(sample.name for sample in family.samples)
        names.update(family.name + suffix for suffix in suffixes.get(family.type, ("",)))
    return names


def dashboard_expressions() -> list[tuple[str, str]]:
    """(panel title, expression) of every query of the dashboard, its variables' too."""
    dashboard = json.loads(DASHBOARD.read_text())
    found = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            found.append((panel["title"], target["expr"]))
    for variable in dashboard["templating"]["list"]:
        query = variable.get("query")
        if isinstance(query, dict):
            found.append((f"variable {variable['name']}", query["query"]))
    return found


def test_the_expression_parser_finds_names_not_functions_labels_or_ranges() -> None:
    expression = (
        "histogram_quantile(0.99, sum by (le, endpoint) (rate(diffbatch_request_latency_seconds_bucket"
        '{job=~"$job",endpoint=~"/v1/.*"}[$__rate_interval]))) / on (job) group_left diffbatch_workers'
    )
    assert metric_names(expression) == {"diffbatch_request_latency_seconds_bucket", "diffbatch_workers"}
    # A variable's label_values(metric, label): its label reads as a name, and is let through.
    assert metric_names("label_values(diffbatch_workers, job)") == {"diffbatch_workers", "job"}


def test_every_metric_the_dashboard_queries_is_one_the_server_exports(server: Server) -> None:
    exported = exported_names(server)
    queried = dashboard_expressions()
    assert len(queried) >= 20
    missing = {
        f"{title}: {name}"
        for title, expression in queried
        for name in metric_names(expression)
        if name not in exported and not (title.startswith("variable") and name == "job")
    }
    assert not missing, sorted(missing)
    panels = [p for p in json.loads(DASHBOARD.read_text())["panels"] if p["type"] != "row"]
    assert all(p.get("targets") for p in panels)  # no panel without a query


def test_the_dashboard_covers_what_an_operator_watches() -> None:
    names = {name for _, expression in dashboard_expressions() for name in metric_names(expression)}
    for watched in (
        "diffbatch_requests_total",
        "diffbatch_request_latency_seconds_bucket",
        "diffbatch_queue_wait_seconds_bucket",
        "diffbatch_num_requests_waiting",
        "diffbatch_batch_size_sum",
        "diffbatch_prompt_cache_hits_total",
        "diffbatch_preemptions_total",
        "diffbatch_moderation_flagged_total",
        "diffbatch_models_resident_bytes",
        "diffbatch_model_state",
    ):
        assert watched in names, watched
