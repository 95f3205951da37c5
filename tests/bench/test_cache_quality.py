"""`python -m bench.cache_quality`'s table, from tallies made by hand (no model)."""

from __future__ import annotations

import numpy as np

from bench.cache_quality import Tally, report
from bench.quality import Accuracy


def tally(value: int, wall_s: float, step_s: float, skipped: int) -> Tally:
    accuracy = Accuracy()
    accuracy.add("background", True)
    accuracy.add("count", value == 0)
    image = np.full((64, 64, 3), value, dtype=np.uint8)
    return Tally([image, image], wall_s, step_s, skipped, 3 * skipped, accuracy)


def test_each_threshold_against_cache_off() -> None:
    table = report({0.0: tally(0, 4.0, 2.0, 0), 0.25: tally(2, 2.0, 1.0, 10)}, count=2)
    off, cached = table.splitlines()[2:]
    assert off.startswith("| off | 0.50 | 1.00 | 2.0 | 1.00 | 0.0 | 0.0 | 100% | 100% | 100.0% | ref |")
    assert cached.startswith("| 0.25 | 1.00 | 2.00 | 1.0 | 2.00 | 5.0 | 15.0 | 100% | 0% | 50.0% |")
    assert cached.endswith(" 42.11 |")  # 20 log10(255 / 2)
