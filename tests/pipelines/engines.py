"""An engine over a tiny model, as the family tests use it, and the pixel comparison."""

from __future__ import annotations

import numpy as np

from engine.core.config import EngineConfig
from engine.core.engine import AsyncEngine
from pipelines.base import PipelineConfig
from server.composition import thread_executor
from tests.threads import THREADS


async def start_batching_engine(model: str) -> AsyncEngine:
    """max_num_seqs 8 and a long admission wait: concurrent requests form one batch."""
    config = PipelineConfig(model=model, num_threads=THREADS)
    engine = AsyncEngine(
        thread_executor(config), EngineConfig(max_num_seqs=8, request_batch_max_wait_ms=5000)
    )
    await engine.start()
    return engine


def difference(a: np.ndarray, b: np.ndarray) -> int:
    """Largest per-pixel difference in 8-bit levels (1 = 1/255)."""
    return int(np.abs(a.astype(np.int16) - b.astype(np.int16)).max())
