"""The work budget (`pipelines.work`): a request exactly at the budget is taken, one
pixel-step over it is refused naming the field that grew most over the default request."""

from __future__ import annotations

import pytest

from engine.request import InvalidRequestError, SamplingParams
from pipelines.work import DEFAULT_WORK_MULTIPLE, check_work, request_work

DEFAULT = SamplingParams(width=64, height=64, num_inference_steps=8)
BUDGET = DEFAULT_WORK_MULTIPLE * request_work(DEFAULT)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(width=128, height=128, num_inference_steps=32),  # 4x the size, 4x the steps
        SamplingParams(width=256, height=256, num_inference_steps=8),
        SamplingParams(width=64, height=64, num_inference_steps=16, n=8),
    ],
)
def test_a_request_at_the_budget_is_taken(params: SamplingParams) -> None:
    assert request_work(params) == BUDGET
    check_work(params, BUDGET, DEFAULT)


@pytest.mark.parametrize(
    ("params", "param"),
    [
        (SamplingParams(width=128, height=128, num_inference_steps=33), "num_inference_steps"),
        (SamplingParams(width=256, height=272, num_inference_steps=8), "size"),
        (SamplingParams(width=64, height=64, num_inference_steps=8, n=17), "n"),
        (SamplingParams(width=64, height=64, num_inference_steps=8, num_frames=17), "seconds"),
    ],
)
def test_a_request_over_the_budget_is_refused_naming_what_grew_most(
    params: SamplingParams, param: str
) -> None:
    with pytest.raises(InvalidRequestError) as refused:
        check_work(params, BUDGET, DEFAULT)
    assert refused.value.param == param
    assert f"budget of {BUDGET:,}" in str(refused.value)
