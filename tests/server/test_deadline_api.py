"""Deadlines over HTTP, in process: an API key's SLO becomes its requests' deadline, and a
request whose deadline cannot be met is refused at once (429, never queued, counted).

The hurried key's SLO (a microsecond) has passed by the time its request is checked, so once
any forward has been measured it is refused however fast this machine is."""

from __future__ import annotations

from pathlib import Path

import pytest

from server.settings import SettingsError, load_settings
from tests.server.conftest import ClientFactory
from tests.server.test_images_api import assert_error
from tests.server.test_priority_api import auth
from tests.server.test_videos_api import Harness, poll

URL = "/v1/images/generations"
KEYS = "hurried:slo=0.000001, patient:slo=600"


async def test_a_deadline_that_cannot_be_met_is_429_with_the_estimate_and_counted(
    make_client: ClientFactory,
) -> None:
    client = await make_client(api_key=KEYS)
    # Nothing measured yet: admitted (and late: 504).
    assert_error(await client.post(URL, json={"prompt": "a"}, headers=auth("hurried")), 504, code="timeout")
    for _ in range(2):  # the warm-up, then a forward measured
        ok = await client.post(URL, json={"prompt": "a"}, headers=auth("patient"))
        assert ok.status_code == 200, ok.text
    refused = await client.post(URL, json={"prompt": "a"}, headers=auth("hurried"))
    message = assert_error(refused, 429, code="deadline_unmeetable")
    assert "would finish in about" in message and "deadline is in" in message and "even alone" in message
    assert int(refused.headers["retry-after"]) >= 1
    assert refused.headers["x-should-retry"] == "false"  # even alone it cannot make it
    metrics = (await client.get("/metrics", headers=auth("patient"))).text
    assert 'diffbatch_requests_refused_total{reason="deadline_unmeetable"} 1.0' in metrics
    assert "diffbatch_requests_aborted_total 1.0" in metrics  # the first (504) only: never queued


async def test_with_deadline_admission_off_a_late_request_runs_into_its_deadline(
    make_client: ClientFactory,
) -> None:
    client = await make_client(api_key=KEYS, deadline_admission="off")
    assert (await client.post(URL, json={"prompt": "a"}, headers=auth("patient"))).status_code == 200
    late = await client.post(URL, json={"prompt": "a"}, headers=auth("hurried"))
    assert_error(late, 504, code="timeout")


@pytest.mark.parametrize("slo", ["-1", "0", "abc", "inf", ""])
def test_a_bad_slo_stops_start_up_naming_it(slo: str) -> None:
    with pytest.raises(SettingsError, match="slo must be") as caught:
        load_settings(None, {"api_key": f"a, sekrit:slo={slo}"})
    assert "API key #2" in str(caught.value) and "sekrit" not in str(caught.value)


def test_a_keys_slo_is_read_with_its_priority() -> None:
    keys = load_settings(None, {"api_key": "live:slo=2.5:priority=-1, batch"}).api_key_entries
    assert [(k.key, k.slo, k.priority) for k in keys] == [("live", 2.5, -1), ("batch", None, 0)]
    with pytest.raises(SettingsError, match="deadline_admission"):
        load_settings(None, {"deadline_admission": "sometimes"})
    # A bare `off` in a YAML preset is a boolean there.
    assert load_settings(None, {"deadline_admission": False}).engine_config().deadline_admission is False
    assert load_settings(None, {"deadline_admission": "on"}).engine_config().deadline_admission is True


async def test_a_requests_timeout_shortens_its_deadline_never_lengthens_it(
    make_client: ClientFactory,
) -> None:
    client = await make_client(api_key=KEYS)
    for _ in range(2):  # the warm-up, then a forward measured
        assert (await client.post(URL, json={"prompt": "a"}, headers=auth("patient"))).status_code == 200
    sooner = await client.post(URL, json={"prompt": "a", "timeout": 0.000001}, headers=auth("patient"))
    assert_error(sooner, 429, code="deadline_unmeetable")
    later = await client.post(URL, json={"prompt": "a", "timeout": 600}, headers=auth("hurried"))
    assert_error(later, 429, code="deadline_unmeetable")  # capped at the key's microsecond
    zero = await client.post(URL, json={"prompt": "a", "timeout": 0}, headers=auth("patient"))
    assert_error(zero, 400, param="timeout")


async def test_a_video_jobs_deadline_is_its_keys_slo_or_its_timeout(tmp_path: Path) -> None:
    async with Harness(tmp_path, api_key=KEYS) as client:
        client.headers.update(auth("patient"))  # polls too; a request's own header wins
        body = {"prompt": "a boat", "seconds": 1, "size": "32x32"}
        for _ in range(2):  # the warm-up, then a forward measured
            created = await client.post("/v1/videos", json=body, headers=auth("patient"))
            assert created.status_code == 200, created.text
            assert (await poll(client, created.json()["id"], {"completed", "failed"}))[
                "status"
            ] == "completed"
        hurried = await client.post("/v1/videos", json=body, headers=auth("hurried"))
        assert_error(hurried, 429, code="deadline_unmeetable")  # refused before any job exists
        sooner = await client.post("/v1/videos", json={**body, "timeout": 0.000001}, headers=auth("patient"))
        assert_error(sooner, 429, code="deadline_unmeetable")
        listed = (await client.get("/v1/videos", headers=auth("patient"))).json()
        assert len(listed["data"]) == 2
