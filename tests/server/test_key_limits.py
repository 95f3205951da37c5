"""Per-key limits: pure units on a fake clock, then over HTTP in process (the real app and
engine over a fake pipeline): 429 naming the limit, counts that drop however a request
ends, the sender reaching the engine, and /metrics by the key's log-safe name."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import httpx
import pytest

from engine.core.handle import RequestHandle
from engine.errors import QueueFullError
from engine.request import GenerationRequest, RequestBatch, RequestOutput
from server.api_keys import ApiKey, parse_api_keys
from server.errors import APIError
from server.key_limits import KeyLimits, TokenBucket
from server.settings import SettingsError, load_settings
from server.state import AppState
from tests.polling import until
from tests.server.conftest import ClientFactory, ImageFakePipeline
from tests.server.test_images_api import assert_error

URL = "/v1/images/generations"


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_token_bucket_allows_a_small_burst_then_the_rate() -> None:
    bucket = TokenBucket.full(rate=2.0, now=0.0)
    assert [bucket.take(0.0) for _ in range(2)] == [0.0, 0.0]  # a second's worth at once
    assert bucket.take(0.0) == pytest.approx(0.5)  # then one each half second
    assert bucket.take(0.5) == 0.0
    slow = TokenBucket.full(rate=0.1, now=0.0)
    assert slow.take(0.0) == 0.0  # at least one request, however slow the rate
    assert slow.take(1.0) == pytest.approx(9.0)


async def test_rate_refusal_names_the_limit_with_retry_after() -> None:
    clock = FakeClock()
    (key,) = parse_api_keys("sekrit:rate=0.5")
    limits = KeyLimits((key,), clock)
    (await limits.admit(key))()
    with pytest.raises(APIError) as caught:
        await limits.admit(key)
    assert caught.value.status == 429 and caught.value.param == "rate"
    assert "rate" in caught.value.message and "sekrit" not in caught.value.message
    assert caught.value.headers == {"Retry-After": "2"}
    clock.now += 2.0
    (await limits.admit(key))()
    assert limits.refused == {("key#1", "rate"): 1}


async def test_max_queue_counts_requests_until_they_end() -> None:
    (key,) = parse_api_keys("sekrit:max_queue=2")
    limits = KeyLimits((key,))
    first, second = await limits.admit(key), await limits.admit(key)
    with pytest.raises(APIError) as caught:
        await limits.admit(key)
    assert caught.value.status == 429 and caught.value.param == "max_queue"
    assert caught.value.headers is not None and "Retry-After" in caught.value.headers
    first()
    first()  # a second release of the same request changes nothing
    assert limits.held["key#1"] == 1
    await limits.admit(key)
    second()
    assert limits.held["key#1"] == 1


class StubEngine:
    """Hands out handles whose futures the test settles, or refuses like a full queue."""

    def __init__(self) -> None:
        self.futures: list[asyncio.Future[RequestOutput]] = []
        self.full = False

    def submit(self, request: GenerationRequest) -> RequestHandle:
        if self.full:
            raise QueueFullError(1, 1.0)
        future: asyncio.Future[RequestOutput] = asyncio.get_running_loop().create_future()
        self.futures.append(future)
        return RequestHandle(request, future, asyncio.Queue(), lambda _: True)


@pytest.mark.parametrize("ending", ["result", "error", "cancelled"])
async def test_the_count_drops_however_the_request_ends(ending: str) -> None:
    key = ApiKey("sekrit", max_queue=1)
    limits, engine = KeyLimits((key,)), StubEngine()
    limits.submit(engine, GenerationRequest("r1", "x"), key, await limits.admit(key))  # type: ignore[arg-type]
    assert limits.held["key#1"] == 1
    future = engine.futures[0]
    if ending == "result":
        future.set_result(RequestOutput(request_id="r1", images=(), seeds=()))
    elif ending == "error":
        future.set_exception(RuntimeError("failed"))
    else:  # an abort, a client gone, a deadline
        future.cancel()
    await until(lambda: limits.held["key#1"] == 0, "the count drops")
    engine.full = True
    with pytest.raises(QueueFullError):
        limits.submit(engine, GenerationRequest("r2", "x"), key, await limits.admit(key))  # type: ignore[arg-type]
    assert limits.held["key#1"] == 0  # refused by the engine: never counted


@pytest.mark.parametrize(
    ("entry", "setting"),
    [
        ("k:max_queue=0", "max_queue"),
        ("k:max_queue=1.5", "max_queue"),
        ("k:rate=0", "rate"),
        ("k:rate=inf", "rate"),
        ("k:rate=fast", "rate"),
        ("k:weight=-1", "weight"),
        ("k:weight=nan", "weight"),
    ],
)
def test_bad_key_limits_stop_start_up_naming_the_setting(entry: str, setting: str) -> None:
    with pytest.raises(SettingsError, match=f"API key #1: {setting} must be"):
        load_settings(None, {"api_key": entry})


def test_key_settings_are_read() -> None:
    (key,) = load_settings(None, {"api_key": "k:weight=2.5:max_queue=4:rate=0.5:priority=3"}).api_key_entries
    assert (key.weight, key.max_queue, key.rate, key.priority) == (2.5, 4, 0.5, 3)
    (plain,) = parse_api_keys("k")
    assert (plain.weight, plain.max_queue, plain.rate) == (1.0, None, None)


SECRET = "whsec_" + "QUJDREVGR0hJSktMTU5PUFFSU1RVVldY"  # base64 of 24 bytes


def test_admin_flag_and_webhook_secret_are_read() -> None:
    admin, tenant, legacy = parse_api_keys(f"a:admin:priority=2, t:webhook_secret={SECRET}, old:colon")
    assert (admin.admin, admin.priority, admin.webhook_secret) == (True, 2, None)
    assert (tenant.admin, tenant.webhook_secret) == (False, SECRET)
    # A colon followed by neither a setting nor a flag stays in the key, as before.
    assert (legacy.key, legacy.admin) == ("old:colon", False)


@pytest.mark.parametrize("secret", ["whsec_short", "nope_QUJDREVGR0hJSktMTU5PUFFSU1RVVldY", "whsec_!!"])
def test_a_bad_webhook_secret_stops_start_up(secret: str) -> None:
    with pytest.raises(SettingsError, match="API key #1: webhook_secret must be"):
        load_settings(None, {"api_key": f"k:webhook_secret={secret}"})


def test_a_tenant_is_a_keyed_digest_of_its_key_never_the_key() -> None:
    one, other = parse_api_keys("sekrit-one,sekrit-two")
    assert one.tenant() != other.tenant()
    assert "sekrit" not in one.tenant() and len(one.tenant()) == 32
    assert one.tenant() == ApiKey("sekrit-one", position=7).tenant()  # the key, not its place
    assert one.tenant(b"another pepper") != one.tenant()


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def metrics(client: httpx.AsyncClient) -> str:
    return (await client.get("/metrics", headers=auth("sekrit-other"))).text


async def tenant_requests(client: httpx.AsyncClient, name: str, count: int) -> bool:
    return f'diffbatch_tenant_requests{{tenant="{name}"}} {float(count)}' in await metrics(client)


class SenderRecordingPipeline(ImageFakePipeline):
    def __init__(self) -> None:
        super().__init__()
        self.senders: list[tuple[str, str, float]] = []

    def forward(self, batch: RequestBatch) -> list[RequestOutput]:
        self.senders.extend((r.prompt, r.tenant, r.tenant_weight) for r in batch.requests)
        return super().forward(batch)


@pytest.fixture
def pipeline() -> SenderRecordingPipeline:
    return SenderRecordingPipeline()


async def test_a_key_past_its_max_queue_gets_429_and_another_key_is_served(
    make_client: ClientFactory, pipeline: SenderRecordingPipeline
) -> None:
    pipeline.gate = threading.Event()
    client = await make_client(api_key="sekrit-limited:max_queue=1:weight=3, sekrit-other", max_num_seqs=1)
    try:
        held = asyncio.create_task(client.post(URL, json={"prompt": "held"}, headers=auth("sekrit-limited")))
        await until(lambda: tenant_requests(client, "key#1", 1), "the limited key's request is in")
        refused = await client.post(URL, json={"prompt": "more"}, headers=auth("sekrit-limited"))
        other = asyncio.create_task(client.post(URL, json={"prompt": "other"}, headers=auth("sekrit-other")))
        await until(lambda: tenant_requests(client, "key#2", 1), "the other key's request is in")
    finally:
        pipeline.gate.set()
    message = assert_error(refused, 429, param="max_queue", code="key_max_queue_exceeded")
    assert "max_queue" in message and int(refused.headers["Retry-After"]) >= 1
    assert (await held).status_code == 200 and (await other).status_code == 200
    await until(lambda: tenant_requests(client, "key#1", 0), "the count drops once answered")
    again = await client.post(URL, json={"prompt": "again"}, headers=auth("sekrit-limited"))
    assert again.status_code == 200, again.text
    assert pipeline.senders == [("held", "key#1", 3.0), ("other", "key#2", 1.0), ("again", "key#1", 3.0)]
    text = await metrics(client)
    assert 'diffbatch_tenant_refusals_total{limit="max_queue",tenant="key#1"} 1.0' in text
    assert "sekrit" not in text  # a key is never a label


async def test_a_key_past_its_rate_gets_429_naming_it(
    make_client: ClientFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The limits come before the model: a key past them loads (or evicts) nothing.
    engine_for, loads = AppState.engine_for, []

    async def counted(self: AppState, *args: Any, **kwargs: Any) -> Any:
        loads.append(args[0])
        return await engine_for(self, *args, **kwargs)

    monkeypatch.setattr(AppState, "engine_for", counted)
    client = await make_client(api_key="sekrit-limited:rate=0.001, sekrit-other")
    first = await client.post(URL, json={"prompt": "a"}, headers=auth("sekrit-limited"))
    assert first.status_code == 200, first.text
    refused = await client.post(URL, json={"prompt": "b"}, headers=auth("sekrit-limited"))
    assert "rate" in assert_error(refused, 429, param="rate", code="key_rate_exceeded")
    assert len(loads) == 1
    assert int(refused.headers["Retry-After"]) > 900
    other = await client.post(URL, json={"prompt": "c"}, headers=auth("sekrit-other"))
    assert other.status_code == 200, other.text
    assert 'diffbatch_tenant_refusals_total{limit="rate",tenant="key#1"} 1.0' in await metrics(client)


async def test_result_cache_hits_count_against_the_rate_not_the_max_queue(
    make_client: ClientFactory, pipeline: SenderRecordingPipeline
) -> None:
    # A hit reaches no engine, but it is a request the key sent: without a token per hit, a
    # key could send repeats past its rate.
    client = await make_client(
        api_key="sekrit-limited:rate=0.001, sekrit-queued:max_queue=1, sekrit-other",
        result_cache_mb=16,
        result_cache_scope="global",  # one key's entry answers the others
    )
    body = {"prompt": "a", "seed": 1}
    assert (await client.post(URL, json=body, headers=auth("sekrit-limited"))).status_code == 200
    repeat = await client.post(URL, json=body, headers=auth("sekrit-limited"))
    assert_error(repeat, 429, param="rate", code="key_rate_exceeded")
    # A key at its max_queue is still answered from the cache: a hit holds no engine work.
    pipeline.gate = threading.Event()
    try:
        assert (await client.post(URL, json=body, headers=auth("sekrit-queued"))).status_code == 200  # a hit
        held = asyncio.create_task(client.post(URL, json={"prompt": "held"}, headers=auth("sekrit-queued")))
        await until(lambda: tenant_requests(client, "key#2", 1), "the queued key's request is in")
        hit = await client.post(URL, json=body, headers=auth("sekrit-queued"))
        assert hit.status_code == 200, hit.text
    finally:
        pipeline.gate.set()
    assert (await held).status_code == 200
    assert len(pipeline.senders) == 2  # the first and the held one; every other was a hit


async def test_a_request_past_its_deadline_frees_its_place(
    make_client: ClientFactory, pipeline: SenderRecordingPipeline
) -> None:
    pipeline.gate = threading.Event()
    client = await make_client(api_key="sekrit-limited:max_queue=1, sekrit-other", request_timeout_s=0.5)
    try:
        late = await client.post(URL, json={"prompt": "late"}, headers=auth("sekrit-limited"))
        assert late.status_code == 504, late.text
        await until(lambda: tenant_requests(client, "key#1", 0), "the count drops at the deadline")
    finally:
        pipeline.gate.set()


async def test_without_keys_requests_have_no_sender(
    make_client: ClientFactory, pipeline: SenderRecordingPipeline
) -> None:
    client = await make_client()
    response = await client.post(URL, json={"prompt": "x"})
    assert response.status_code == 200, response.text
    assert pipeline.senders == [("x", "", 1.0)]
    assert "diffbatch_tenant_requests{" not in (await client.get("/metrics")).text
