"""`python -m bench.cache_profile`'s table, from clocks made by hand (no model)."""

from __future__ import annotations

from bench.cache_profile import PARTS, report


def clock(step: float, first: float, rest: float) -> dict[str, float]:
    return {**dict.fromkeys(PARTS, 0.0), "step": step, "first block": first, "rest of the blocks": rest}


def test_medians_in_ms_and_shares_of_the_step() -> None:
    runs = [clock(1.0, 0.25, 0.5), clock(9.0, 1.0, 1.0), clock(2.0, 0.5, 1.5)]
    off = report({0.0: runs}).splitlines()[2]
    assert off == "| off | 0.0 | 2000.0 | 0.0 | 500.0 | 1000.0 | 0.0 | 0.0 | 25% | 50% |"
