"""The resident set's kinds, read from /proc/self/status: parsing, and a sampler that sees
memory the process touches as anonymous."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench.resident import parse_status

STATUS = """Name:\tpython
VmPeak:\t 9000000 kB
VmHWM:\t 3675136 kB
VmRSS:\t  414720 kB
RssAnon:\t  307200 kB
RssFile:\t  102400 kB
RssShmem:\t    5120 kB
Threads:\t4
"""


def test_status_fields_in_mib() -> None:
    assert parse_status(STATUS) == {
        "VmHWM": 3589.0,
        "VmRSS": 405.0,
        "RssAnon": 300.0,
        "RssFile": 100.0,
        "RssShmem": 5.0,
    }


def test_a_unit_other_than_kb_is_refused() -> None:
    with pytest.raises(ValueError, match="RssAnon"):
        parse_status("RssAnon:\t 1 MB\n")


# Run in a fresh interpreter: in a test process that has run others (a pytest-xdist worker),
# threads left by earlier tests may free memory while this one touches its block, and the
# anonymous set then need not grow by the block (it did not, once, in CI).
TOUCH_A_BLOCK = """
import json
from bench.resident import ResidentSampler
sampler = ResidentSampler()
sampler.start()
sampler.reset()
before = sampler.sample()["RssAnon"]
block = b"\\x01" * (64 * 2**20)  # written: every page touched
peaks = sampler.sample()
del block
after = sampler.stop()
print(json.dumps([before, peaks["RssAnon"], after["RssAnon"]]))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_touched_heap_shows_as_anonymous_peak() -> None:
    run = subprocess.run([sys.executable, "-c", TOUCH_A_BLOCK], capture_output=True, text=True, check=True)
    before, peak, after = json.loads(run.stdout)
    assert peak - before >= 60
    assert after >= peak  # a peak is kept after the memory is freed
