"""How many torch threads a test's pipeline or server gets: the machine's cores shared among
the run's pytest-xdist workers.

Two workers that each take every core oversubscribe them, and torch's OpenMP threads then
wait on each other: a tiny-model test ran 2.5 times slower beside a twin than alone with two
threads each, and no slower than alone with one each (2 cores)."""

from __future__ import annotations

import os

WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
THREADS = max(1, (os.cpu_count() or 1) // WORKERS)
