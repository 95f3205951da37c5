"""The servers and pipelines a test starts take this pytest-xdist worker's share of the cores."""

from __future__ import annotations

import os

from tests.threads import THREADS, WORKERS


def test_servers_a_test_starts_get_this_workers_share_of_the_cores() -> None:
    """`OMP_NUM_THREADS`, what a spawned server without `--num-threads` takes, is the worker's
    share (it was every core when xdist's controller set it for its workers)."""
    assert os.environ["OMP_NUM_THREADS"] == str(THREADS)
    assert max(1, (os.cpu_count() or 1) // WORKERS) == THREADS
