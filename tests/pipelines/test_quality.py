"""OpenAI's `quality` as step counts: shares of the model's default, never below 2."""

from __future__ import annotations

import pytest

from pipelines.work import steps_for_quality


@pytest.mark.parametrize(
    ("default", "low", "medium", "high"),
    [(50, 13, 25, 50), (28, 7, 14, 28), (8, 2, 4, 8), (4, 2, 2, 4), (1, 1, 1, 1)],
)
def test_quality_tiers_are_shares_of_the_default_steps(
    default: int, low: int, medium: int, high: int
) -> None:
    tiers = [steps_for_quality(default, q) for q in ("low", "medium", "high")]
    assert tiers == [low, medium, high]
