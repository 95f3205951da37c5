"""`python -m bench.cache_quality`'s table, from tallies made by hand (no model)."""

from __future__ import annotations

import numpy as np

from bench.cache_quality import Tally, choices_of, report
from engine.request import CacheChoice
from pipelines.trained.quality import Accuracy


def tally(value: int, walls: list[float], steps: list[float], skipped: int) -> Tally:
    accuracy = Accuracy()
    accuracy.add("background", True)
    accuracy.add("count", value == 0)
    image = np.full((64, 64, 3), value, dtype=np.uint8)
    return Tally([image, image], walls, steps, 2 * len(walls), skipped, 3 * skipped, accuracy)


def test_each_threshold_against_cache_off_in_total_and_group_by_group() -> None:
    """Three groups of 2 images; cache off's second group met a burst of load: the totals
    show it, the median of the per-group ratios does not."""
    off = tally(0, [2.0, 20.0, 2.0], [1.0, 10.0, 1.0], 0)
    cached = tally(2, [1.0, 1.0, 1.0], [0.5, 0.5, 0.5], 10)
    table = report({"off": off, "0.25": cached})
    first, second = table.splitlines()[2:]
    assert first.startswith("| off | 0.25 | 1.00 | 1.00 | 1.00 | 1.00 | 0.0 | 0.0 | 100% | 100% | 100.0% |")
    assert first.endswith(" ref |")
    assert second.startswith("| 0.25 | 2.00 | 8.00 | 2.00 | 0.50 | 2.00 | 5.0 | 15.0 | 100% | 0% | 50.0% |")
    assert second.endswith(" 42.11 |")  # 20 log10(255 / 2)


def test_taylor_seer_settings_are_interval_warmup_order() -> None:
    choices = choices_of("taylorseer", "2/2/1,1/0/0,3/1/2")
    assert choices == {
        "off": CacheChoice("none"),
        "2/2/1": CacheChoice("taylorseer", interval=2, warmup=2, order=1),
        "3/1/2": CacheChoice("taylorseer", interval=3, warmup=1, order=2),
    }  # an interval of 1 is the cache off, run once
    assert list(choices_of("first-block", "0.1,0")) == ["off", "0.1"]
    header = report({"off": tally(0, [4.0], [2.0], 0)}, setting="interval/warmup/order")
    assert header.startswith("| interval/warmup/order | images/s |")
