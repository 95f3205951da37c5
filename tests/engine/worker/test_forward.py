"""Per-request fate inside `run_batch`: output checks and isolation of a failing request."""

from __future__ import annotations

import pytest

from engine.request import RequestBatch, RequestOutput
from engine.worker.forward import run_batch
from tests.engine.fakes import FakePipeline, make_request


def batch_of(*prompts: str) -> RequestBatch:
    return RequestBatch(
        key=("k",), requests=tuple(make_request(f"r{i}", prompt=p) for i, p in enumerate(prompts))
    )


def test_one_forward_when_everything_succeeds() -> None:
    pipeline = FakePipeline()
    result = run_batch(pipeline, batch_of(*(f"p{i}" for i in range(8))))
    assert len(pipeline.forwards) == 1 and len(result.outputs) == 8 and not result.errors
    assert [f.num_requests for f in result.forwards] == [8]


def test_a_failing_request_fails_alone_and_its_peers_succeed() -> None:
    pipeline = FakePipeline()
    prompts = [f"p{i}" for i in range(8)]
    prompts[5] = "FAIL here"
    result = run_batch(pipeline, batch_of(*prompts))
    assert set(result.errors) == {"r5"}
    assert sorted(result.outputs) == sorted(f"r{i}" for i in range(8) if i != 5)
    assert result.outputs["r0"].images == (("p0", 0),)
    # Bisection: 8 -> 4+4 -> the failing 4 splits 2+2 -> 1+1; so 1 + 2 + 2 + 2 forwards.
    assert len(pipeline.forwards) == 7


class WrongCountPipeline(FakePipeline):
    def forward(self, batch: RequestBatch) -> list[RequestOutput]:
        return super().forward(batch)[:-1]


def test_an_output_count_mismatch_is_an_error_not_a_silent_misroute() -> None:
    result = run_batch(WrongCountPipeline(), batch_of("a"))
    assert "exactly one RequestOutput per request" in str(result.errors["r0"])


@pytest.mark.parametrize("n", [1, 3])
def test_each_request_gets_its_n_images(n: int) -> None:
    batch = RequestBatch(key=("k",), requests=(make_request("a", n=n, seed=10),))
    result = run_batch(FakePipeline(), batch)
    assert result.outputs["a"].seeds == tuple(range(10, 10 + n))
